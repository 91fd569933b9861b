/* MPI_Allreduce (f32 sum) timed as `kolo bench collectives` times Kolo's (issue #37): per size,
 * a warm-up, then TRIALS trials of back-to-back calls lasting about TRIAL_SECS each; a trial's
 * time is the slowest rank's mean, a size's the median over trials; busbw = size / time x
 * 2(n-1)/n, as nccl-tests and Kolo report it. Open MPI called from C, no Python in between.
 *
 *   mpicc -O2 -o mpi_allreduce bench/mpi_allreduce.c
 *   mpirun -n 2 --mca btl self,vader ./mpi_allreduce MIN MAX FACTOR TRIALS TRIAL_SECS
 * prints "bytes time_us busbw_GBps" per size on rank 0. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double slowest(double t) {
  double m;
  MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc != 6) {
    if (rank == 0) fprintf(stderr, "usage: %s MIN MAX FACTOR TRIALS TRIAL_SECS\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  long min = atol(argv[1]), max = atol(argv[2]), factor = atol(argv[3]);
  int trials = atoi(argv[4]);
  double trial_secs = atof(argv[5]);
  float *buf = malloc((size_t)max);
  memset(buf, 0, (size_t)max);
  double *times = malloc(sizeof(double) * (size_t)trials);
  for (long bytes = min; bytes <= max; bytes *= factor) {
    int count = (int)(bytes / 4);
    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); /* warm-up */
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double one = slowest(MPI_Wtime() - t);
    long iters = (long)ceil(trial_secs / (one > 1e-7 ? one : 1e-7));
    if (iters < 3) iters = 3;
    if (iters > 100000) iters = 100000;
    for (int k = 0; k < trials; k++) {
      MPI_Barrier(MPI_COMM_WORLD);
      t = MPI_Wtime();
      for (long i = 0; i < iters; i++) MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      times[k] = slowest((MPI_Wtime() - t) / (double)iters);
    }
    qsort(times, (size_t)trials, sizeof(double), cmp);
    double med = times[trials / 2];
    if (rank == 0) printf("%ld %.2f %.3f\n", bytes, med * 1e6, (double)bytes / med / 1e9 * 2.0 * (n - 1) / n);
    fflush(stdout);
  }
  free(times);
  free(buf);
  MPI_Finalize();
  return 0;
}
