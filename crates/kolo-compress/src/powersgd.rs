//! PowerSGD (Vogels et al. 2019): a gradient matrix M (n x m) is sent as two thin factors,
//! P = M Q (n x r) and Q' = Mᵀ P̂ (m x r) with P̂ the orthonormalised P; the approximation is
//! P̂ Q'ᵀ. Across ranks the factors are all-reduced (averaged) between the two halves, Q is
//! warm-started from the previous step, and the error is fed back. The pieces here are the
//! per-rank linear algebra; the exchange is the strategy's.

/// `p (n x r) = m (n x cols) · q (cols x r)`, row-major.
pub fn matmul(m: &[f32], rows: usize, cols: usize, q: &[f32], r: usize, p: &mut [f32]) {
    assert_eq!(m.len(), rows * cols);
    assert_eq!(q.len(), cols * r);
    assert_eq!(p.len(), rows * r);
    p.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let out = &mut p[i * r..(i + 1) * r];
        for (k, mk) in row.iter().enumerate() {
            let qk = &q[k * r..(k + 1) * r];
            out.iter_mut().zip(qk).for_each(|(o, q)| *o += mk * q);
        }
    }
}

/// `q (cols x r) = mᵀ (cols x rows) · p (rows x r)`.
pub fn matmul_t(m: &[f32], rows: usize, cols: usize, p: &[f32], r: usize, q: &mut [f32]) {
    assert_eq!(m.len(), rows * cols);
    assert_eq!(p.len(), rows * r);
    assert_eq!(q.len(), cols * r);
    q.iter_mut().for_each(|v| *v = 0.0);
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let pi = &p[i * r..(i + 1) * r];
        for (k, mk) in row.iter().enumerate() {
            q[k * r..(k + 1) * r].iter_mut().zip(pi).for_each(|(o, p)| *o += mk * p);
        }
    }
}

/// Orthonormalises the r columns of `p` (rows x r, row-major) in place by modified
/// Gram-Schmidt in f64; a column that vanishes stays zero.
pub fn orthonormalize(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f64 = (0..rows).map(|i| f64::from(p[i * r + j]) * f64::from(p[i * r + k])).sum();
            for i in 0..rows {
                p[i * r + j] -= (dot * f64::from(p[i * r + k])) as f32;
            }
        }
        let norm: f64 = (0..rows).map(|i| f64::from(p[i * r + j]).powi(2)).sum::<f64>().sqrt();
        for i in 0..rows {
            p[i * r + j] = if norm > 1e-12 { (f64::from(p[i * r + j]) / norm) as f32 } else { 0.0 };
        }
    }
}

/// `out (rows x cols) = p (rows x r) · qᵀ (r x cols)`.
pub fn reconstruct(p: &[f32], rows: usize, q: &[f32], cols: usize, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), rows * cols);
    for i in 0..rows {
        let pi = &p[i * r..(i + 1) * r];
        for k in 0..cols {
            let qk = &q[k * r..(k + 1) * r];
            out[i * cols + k] = pi.iter().zip(qk).map(|(a, b)| a * b).sum();
        }
    }
}

/// Whether a `rows x cols` matrix is worth compressing at rank r (the factors must be smaller
/// than the matrix; torch's hook leaves such tensors uncompressed too).
pub fn worth_it(rows: usize, cols: usize, r: usize) -> bool {
    rows > 1 && cols > 1 && (rows + cols) * r < rows * cols
}

/// One rank's compression of `m` without communication (a world of one): P = M Q, orthonormalise,
/// Q = Mᵀ P, M̂ = P Qᵀ. `q` is the warm start and is updated.
pub fn compress_local(m: &[f32], rows: usize, cols: usize, r: usize, q: &mut [f32], out: &mut [f32]) {
    let mut p = vec![0f32; rows * r];
    matmul(m, rows, cols, q, r, &mut p);
    orthonormalize(&mut p, rows, r);
    matmul_t(m, rows, cols, &p, r, q);
    reconstruct(&p, rows, q, cols, r, out);
}
