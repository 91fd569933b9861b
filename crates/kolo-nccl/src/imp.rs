//! The backend proper (feature `nccl`).
//!
//! One `NcclComm` owns an NCCL communicator, a CUDA stream of its own and staging buffers.
//! Operations on one communicator are serialised (NCCL requires every rank to issue them in
//! the same order, and Kolo's background threads may share a communicator). Host buffers (the
//! `Communicator` trait) are copied to the GPU, reduced there and copied back; the `*_device`
//! methods work on GPU buffers directly.

use crate::setup_error;
use cudarc::driver::{sys as cu, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::sys as nc;
use kolo_base::{shard_range, DType, Rank, WorldSize};
use kolo_comm::communicator::validate;
use kolo_comm::reduce::finish_avg;
use kolo_comm::{BufMut, BufRef, CommError, Communicator, OpKind, ReduceOp};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of the header sent before every point-to-point payload: tag and length, so that a
/// mismatched pair is named instead of silently delivering the wrong message (NCCL has no tags).
const HEADER: usize = 16;

/// Runs `f`, turning cudarc's panic when `libcuda`/`libnccl` cannot be loaded into an error
/// (the panic hook is silenced meanwhile: the error says it all).
fn loading<R>(rank: Rank, what: &str, f: impl FnOnce() -> R) -> Result<R, CommError> {
    static HOOK: Mutex<()> = Mutex::new(());
    let _one = HOOK.lock().unwrap_or_else(|p| p.into_inner());
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(prev);
    r.map_err(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        let msg = msg.split(". Ensure").next().unwrap_or(&msg).to_string();
        setup_error(
            rank,
            format!("{what}: {msg}. Needs the NVIDIA driver (libcuda.so.1) and NCCL: put NCCL's lib folder on LD_LIBRARY_PATH; where it holds only libnccl.so.2 (pip's nvidia-nccl), add a libnccl.so link to it beside"),
        )
    })
}

/// Number of CUDA devices this process sees (0 where there is no driver).
pub fn cuda_device_count() -> usize {
    loading(Rank(0), "cuda", || CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)).unwrap_or(0)
}

/// NCCL's version as (major, minor, patch), or an error when libnccl cannot be loaded.
pub fn nccl_version() -> Result<(u32, u32, u32), CommError> {
    let code = loading(Rank(0), "loading NCCL", cudarc::nccl::result::get_nccl_version)?
        .map_err(|e| setup_error(Rank(0), format!("ncclGetVersion: {}", nccl_text(e.0, None))))? as u32;
    Ok(if code >= 10000 { (code / 10000, code / 100 % 100, code % 100) } else { (code / 1000, code / 100 % 10, code % 100) })
}

fn nccl_text(r: nc::ncclResult_t, comm: Option<nc::ncclComm_t>) -> String {
    // SAFETY: NCCL returns static strings (or null); the comm, where given, is live.
    unsafe {
        let s = nc::ncclGetErrorString(r);
        let mut t = if s.is_null() { format!("{r:?}") } else { std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned() };
        let last = nc::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()));
        if !last.is_null() {
            let l = std::ffi::CStr::from_ptr(last).to_string_lossy();
            if !l.is_empty() {
                t = format!("{t}: {l}");
            }
        }
        t
    }
}

fn nccl_type(d: DType) -> nc::ncclDataType_t {
    use nc::ncclDataType_t as T;
    match d {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 => T::ncclUint8,
    }
}

/// Kolo's reduction as NCCL's. `Avg` on host buffers is a sum finished on the host exactly as
/// the other backends finish it (same rounding, integers included); on GPU buffers it is NCCL's.
fn nccl_op(op: ReduceOp, host: bool) -> nc::ncclRedOp_t {
    use nc::ncclRedOp_t as O;
    match op {
        ReduceOp::Sum => O::ncclSum,
        ReduceOp::Avg if host => O::ncclSum,
        ReduceOp::Avg => O::ncclAvg,
        ReduceOp::Min => O::ncclMin,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Product => O::ncclProd,
    }
}

/// Element types of the `*_device` collectives.
pub trait NcclElem: DeviceRepr + ValidAsZeroBits + Copy {
    const DTYPE: DType;
}
impl NcclElem for f32 {
    const DTYPE: DType = DType::F32;
}
impl NcclElem for f64 {
    const DTYPE: DType = DType::F64;
}
impl NcclElem for i32 {
    const DTYPE: DType = DType::I32;
}
impl NcclElem for i64 {
    const DTYPE: DType = DType::I64;
}
impl NcclElem for u8 {
    const DTYPE: DType = DType::U8;
}

/// Raw NCCL communicator handle (a pointer NCCL lets any thread use, one call at a time).
struct Handle(nc::ncclComm_t);
// SAFETY: every use of the handle is serialised by `NcclComm::op`.
unsafe impl Send for Handle {}

struct Staging {
    a: Option<CudaSlice<u8>>,
    b: Option<CudaSlice<u8>>,
}

pub struct NcclComm {
    comm: Mutex<Handle>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    timeout_ms: AtomicU64,
    seq: AtomicU64,
    /// Set once an operation failed or timed out: the communicator was aborted.
    broken: Mutex<Option<CommError>>,
    aborted: AtomicBool,
    staging: Mutex<Staging>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {} on cuda:{})", self.rank, self.size, self.ctx.ordinal())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let h = self.comm.get_mut().unwrap_or_else(|p| p.into_inner());
        if h.0.is_null() || self.aborted.load(Ordering::SeqCst) {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the handle is live and no operation is in flight (we own `self`).
        unsafe {
            nc::ncclCommDestroy(h.0);
        }
    }
}

impl NcclComm {
    /// See [`crate::connect`].
    pub fn connect(boot: &dyn Communicator, device: usize, timeout: Duration) -> Result<Arc<NcclComm>, CommError> {
        let (rank, size) = (boot.rank(), boot.world_size().get());
        // Rank 0 makes the id; byte 0 says whether it could (the others must not wait for an id
        // that never comes), bytes 1.. are the id.
        let mut msg = [0u8; 129];
        let mut own_err = None;
        if rank.get() == 0 {
            match loading(rank, "loading NCCL", cudarc::nccl::result::get_uniqueid) {
                Ok(Ok(id)) => {
                    msg[0] = 1;
                    for (d, s) in msg[1..].iter_mut().zip(id.internal.iter()) {
                        *d = *s as u8;
                    }
                }
                Ok(Err(e)) => own_err = Some(setup_error(rank, format!("ncclGetUniqueId: {}", nccl_text(e.0, None)))),
                Err(e) => own_err = Some(e),
            }
        }
        boot.broadcast(BufMut::from(&mut msg[..]), Rank(0))?;
        if let Some(e) = own_err {
            return Err(e);
        }
        if msg[0] != 1 {
            return Err(setup_error(rank, "rank 0 could not create the NCCL unique id (see its error)".into()));
        }
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(msg[1..].iter()) {
            *d = *s as _;
        }

        let count = cuda_device_count();
        if count == 0 {
            return Err(setup_error(rank, "no CUDA device is visible to this process (nvidia-smi; CUDA_VISIBLE_DEVICES)".into()));
        }
        let ordinal = device % count;
        let ctx = loading(rank, "CUDA", || CudaContext::new(ordinal))?
            .map_err(|e| setup_error(rank, format!("opening cuda:{ordinal}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| setup_error(rank, format!("creating a stream on cuda:{ordinal}: {e:?}")))?;

        // ncclCommInitRank blocks until every rank joined: run it where a deadline can be kept.
        let (tx, rx) = std::sync::mpsc::channel();
        let init_ctx = ctx.clone();
        let (r, n) = (rank.get() as i32, size as i32);
        std::thread::Builder::new()
            .name("kolo-nccl-init".into())
            .spawn(move || {
                let res = loading(Rank(r as usize), "loading NCCL", || {
                    let _ = init_ctx.bind_to_thread();
                    let mut c: nc::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `c` is a valid out-pointer; the id came from rank 0.
                    let st = unsafe { nc::ncclCommInitRank(&mut c, n, id, r) };
                    (st, Handle(c))
                });
                let _ = tx.send(res);
            })
            .map_err(|e| setup_error(rank, format!("spawning the NCCL init thread: {e}")))?;
        let late = || {
            let secs = timeout.as_secs_f64();
            let what = format!("ncclCommInitRank ({size} ranks, cuda:{ordinal}) did not complete within {secs:.1} s");
            setup_error(rank, format!("{what}: a rank never joined, or its GPU hung"))
        };
        let (st, handle) = match rx.recv_timeout(timeout) {
            Ok(res) => res?,
            Err(_) => return Err(late()),
        };
        if st != nc::ncclResult_t::ncclSuccess {
            return Err(setup_error(rank, format!("ncclCommInitRank ({size} ranks, cuda:{ordinal}): {}", nccl_text(st, None))));
        }
        Ok(Arc::new(NcclComm::wrap(handle, ctx, stream, rank.get(), size, timeout)))
    }

    fn wrap(handle: Handle, ctx: Arc<CudaContext>, stream: Arc<CudaStream>, rank: usize, size: usize, timeout: Duration) -> NcclComm {
        NcclComm {
            comm: Mutex::new(handle),
            ctx,
            stream,
            rank,
            size,
            timeout_ms: AtomicU64::new(timeout.as_millis().max(1) as u64),
            seq: AtomicU64::new(0),
            broken: Mutex::new(None),
            aborted: AtomicBool::new(false),
            staging: Mutex::new(Staging { a: None, b: None }),
        }
    }

    /// The stream NCCL runs on (work on other streams is ordered before it by cudarc's events).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn bad(&self, op: OpKind, what: String) -> CommError {
        CommError::InvalidArgument { op, rank: Rank(self.rank), what }
    }

    fn cuda_err(&self, op: OpKind, what: String) -> CommError {
        CommError::Setup { op, rank: Rank(self.rank), what }
    }

    /// Runs one operation: `enqueue` issues NCCL calls on the stream (with the handle), then the
    /// stream is polled until done, NCCL reports an asynchronous error, or the deadline passes;
    /// the last two abort the communicator. `after` runs (still serialised) once it completed.
    fn op<R>(
        &self,
        op: OpKind,
        enqueue: impl FnOnce(nc::ncclComm_t, nc::cudaStream_t) -> Result<(), String>,
        after: impl FnOnce() -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let h = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = self.broken.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return Err(e.clone().into_aborted(Rank(self.rank)));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.ctx.bind_to_thread().map_err(|e| self.cuda_err(op, format!("binding cuda:{}: {e:?}", self.ctx.ordinal())))?;
        let fail = |e: CommError| -> CommError {
            // SAFETY: the handle is live; abort is allowed with operations in flight.
            unsafe {
                nc::ncclCommAbort(h.0);
            }
            self.aborted.store(true, Ordering::SeqCst);
            *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            e
        };
        if let Err(what) = enqueue(h.0, self.stream.cu_stream() as nc::cudaStream_t) {
            return Err(fail(CommError::Protocol { op, rank: Rank(self.rank), seq, peer: Rank(self.rank), what }));
        }
        let start = Instant::now();
        let limit = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        let mut spins = 0u32;
        loop {
            // SAFETY: the stream is live.
            match unsafe { cu::cuStreamQuery(self.stream.cu_stream()) } {
                cu::CUresult::CUDA_SUCCESS => break,
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(fail(self.cuda_err(op, format!("#{seq}: CUDA stream error {e:?}")))),
            }
            let mut async_err = nc::ncclResult_t::ncclSuccess;
            // SAFETY: the handle is live; `async_err` is a valid out-pointer.
            unsafe {
                nc::ncclCommGetAsyncError(h.0, &mut async_err);
            }
            if async_err != nc::ncclResult_t::ncclSuccess && async_err != nc::ncclResult_t::ncclInProgress {
                let what = nccl_text(async_err, Some(h.0));
                return Err(fail(CommError::Protocol {
                    op,
                    rank: Rank(self.rank),
                    seq,
                    peer: Rank(self.rank),
                    what: format!("NCCL: {what}"),
                }));
            }
            if start.elapsed() > limit {
                // NCCL cannot say which rank is behind: every other rank is a suspect.
                let missing = (0..self.size).filter(|r| *r != self.rank).map(Rank).collect();
                return Err(fail(CommError::Timeout { op, rank: Rank(self.rank), seq, waited: start.elapsed(), missing }));
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        drop(h);
        after()
    }

    /// Staging buffers of at least `a` and `b` bytes (grown, never shrunk).
    fn staged<R>(
        &self,
        a: usize,
        b: usize,
        f: impl FnOnce(&mut CudaSlice<u8>, &mut CudaSlice<u8>) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut s = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let grow = |slot: &mut Option<CudaSlice<u8>>, n: usize| -> Result<(), CommError> {
            if slot.as_ref().is_none_or(|x| x.len() < n) {
                *slot = None;
                *slot =
                    Some(self.stream.alloc_zeros::<u8>(n.max(1)).map_err(|e| {
                        self.cuda_err(OpKind::Setup, format!("allocating {n} bytes on cuda:{}: {e:?}", self.ctx.ordinal()))
                    })?);
            }
            Ok(())
        };
        grow(&mut s.a, a)?;
        grow(&mut s.b, b)?;
        let Staging { a: Some(x), b: Some(y) } = &mut *s else { unreachable!("grown above") };
        f(x, y)
    }

    fn htod(&self, op: OpKind, src: &[u8], dst: &mut CudaSlice<u8>, at: usize) -> Result<(), CommError> {
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(at..at + src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(|e| self.cuda_err(op, format!("copy to cuda:{}: {e:?}", self.ctx.ordinal())))
    }

    fn dtoh(&self, op: OpKind, src: &CudaSlice<u8>, at: usize, dst: &mut [u8]) -> Result<(), CommError> {
        if dst.is_empty() {
            return Ok(());
        }
        let view = src.slice(at..at + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(|e| self.cuda_err(op, format!("copy from cuda:{}: {e:?}", self.ctx.ordinal())))?;
        self.stream.synchronize().map_err(|e| self.cuda_err(op, format!("cuda:{}: {e:?}", self.ctx.ordinal())))
    }

    fn ptr(&self, s: &CudaSlice<u8>) -> usize {
        let (p, _sync) = s.device_ptr(&self.stream);
        p as usize
    }

    fn check_root(&self, op: OpKind, root: Rank) -> Result<(), CommError> {
        validate::root(op, self.rank(), self.world_size(), root)
    }

    /// Equal-count shards (NCCL's all-gather/reduce-scatter) for Kolo's `shard_range` shards,
    /// which differ by one element when the length is not a multiple of the world size: each
    /// shard is padded to the largest.
    fn max_shard(&self, len: usize) -> usize {
        len.div_ceil(self.size)
    }

    // ----- GPU buffers -----

    /// In place on a GPU buffer; `Avg` is NCCL's.
    pub fn all_reduce_device<T: NcclElem>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), CommError> {
        let n = buf.len();
        let (p, _s) = buf.device_ptr_mut(&self.stream);
        self.op(
            OpKind::AllReduce,
            |c, s| check(unsafe { nc::ncclAllReduce(p as _, p as _, n, nccl_type(T::DTYPE), nccl_op(op, false), c, s) }),
            || Ok(()),
        )
    }

    pub fn broadcast_device<T: NcclElem>(&self, buf: &mut CudaSlice<T>, root: Rank) -> Result<(), CommError> {
        self.check_root(OpKind::Broadcast, root)?;
        let n = buf.len();
        let (p, _s) = buf.device_ptr_mut(&self.stream);
        self.op(
            OpKind::Broadcast,
            |c, s| check(unsafe { nc::ncclBroadcast(p as _, p as _, n, nccl_type(T::DTYPE), root.get() as i32, c, s) }),
            || Ok(()),
        )
    }

    /// `output.len() == world_size * input.len()`; rank r's input lands at `r * input.len()`.
    pub fn all_gather_device<T: NcclElem>(&self, input: &CudaSlice<T>, output: &mut CudaSlice<T>) -> Result<(), CommError> {
        if output.len() != input.len() * self.size {
            return Err(
                self.bad(OpKind::AllGather, format!("output of {} elements for {} ranks x {}", output.len(), self.size, input.len()))
            );
        }
        let n = input.len();
        let (i, _a) = input.device_ptr(&self.stream);
        let (o, _b) = output.device_ptr_mut(&self.stream);
        self.op(OpKind::AllGather, |c, s| check(unsafe { nc::ncclAllGather(i as _, o as _, n, nccl_type(T::DTYPE), c, s) }), || Ok(()))
    }

    /// `input.len() == world_size * output.len()`; this rank gets its block of the reduction.
    pub fn reduce_scatter_device<T: NcclElem>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        if input.len() != output.len() * self.size {
            return Err(
                self.bad(OpKind::ReduceScatter, format!("input of {} elements for {} ranks x {}", input.len(), self.size, output.len()))
            );
        }
        let n = output.len();
        let (i, _a) = input.device_ptr(&self.stream);
        let (o, _b) = output.device_ptr_mut(&self.stream);
        self.op(
            OpKind::ReduceScatter,
            |c, s| check(unsafe { nc::ncclReduceScatter(i as _, o as _, n, nccl_type(T::DTYPE), nccl_op(op, false), c, s) }),
            || Ok(()),
        )
    }
}

fn check(r: nc::ncclResult_t) -> Result<(), String> {
    if r == nc::ncclResult_t::ncclSuccess || r == nc::ncclResult_t::ncclInProgress {
        Ok(())
    } else {
        Err(format!("NCCL: {}", nccl_text(r, None)))
    }
}

fn header(tag: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&0x4b4f_4c4fu32.to_le_bytes());
    h[4..8].copy_from_slice(&tag.to_le_bytes());
    h[8..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

impl Communicator for NcclComm {
    fn rank(&self) -> Rank {
        Rank(self.rank)
    }
    fn world_size(&self) -> WorldSize {
        WorldSize::new(self.size).expect("NCCL communicators are not empty")
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let (d, len) = (buf.dtype(), buf.len());
        if len == 0 {
            return Ok(()); // every rank passes the same length
        }
        let bytes = buf.bytes().len();
        self.staged(bytes, 0, |a, _| {
            self.htod(OpKind::AllReduce, buf.bytes(), a, 0)?;
            let p = self.ptr(a);
            self.op(
                OpKind::AllReduce,
                |c, s| check(unsafe { nc::ncclAllReduce(p as _, p as _, len, nccl_type(d), nccl_op(op, true), c, s) }),
                || self.dtoh(OpKind::AllReduce, a, 0, buf.bytes_mut()),
            )
        })?;
        finish_avg(d, op, buf.bytes_mut(), self.size);
        Ok(())
    }

    fn reduce(&self, mut buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError> {
        self.check_root(OpKind::Reduce, root)?;
        let (d, len) = (buf.dtype(), buf.len());
        if len == 0 {
            return Ok(());
        }
        let me = root.get() == self.rank;
        self.staged(buf.bytes().len(), 0, |a, _| {
            self.htod(OpKind::Reduce, buf.bytes(), a, 0)?;
            let p = self.ptr(a);
            self.op(
                OpKind::Reduce,
                |c, s| check(unsafe { nc::ncclReduce(p as _, p as _, len, nccl_type(d), nccl_op(op, true), root.get() as i32, c, s) }),
                || if me { self.dtoh(OpKind::Reduce, a, 0, buf.bytes_mut()) } else { Ok(()) },
            )
        })?;
        if me {
            finish_avg(d, op, buf.bytes_mut(), self.size);
        }
        Ok(())
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: Rank) -> Result<(), CommError> {
        self.check_root(OpKind::Broadcast, root)?;
        let n = buf.bytes().len();
        if n == 0 {
            return Ok(());
        }
        self.staged(n, 0, |a, _| {
            if root.get() == self.rank {
                self.htod(OpKind::Broadcast, buf.bytes(), a, 0)?;
            }
            let p = self.ptr(a);
            self.op(
                OpKind::Broadcast,
                |c, s| check(unsafe { nc::ncclBroadcast(p as _, p as _, n, nc::ncclDataType_t::ncclUint8, root.get() as i32, c, s) }),
                || self.dtoh(OpKind::Broadcast, a, 0, buf.bytes_mut()),
            )
        })
    }

    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        let (esz, len) = (output.dtype().size_bytes(), output.len());
        let ws = self.world_size();
        validate::all_gather(self.rank(), ws, &input, &output)?;
        if len == 0 {
            return Ok(());
        }
        let m = self.max_shard(len) * esz;
        self.staged(m, m * self.size, |a, b| {
            self.htod(OpKind::AllGather, input.bytes(), a, 0)?;
            let (pa, pb) = (self.ptr(a), self.ptr(b));
            self.op(
                OpKind::AllGather,
                |c, s| check(unsafe { nc::ncclAllGather(pa as _, pb as _, m, nc::ncclDataType_t::ncclUint8, c, s) }),
                || {
                    for r in 0..self.size {
                        let sh = shard_range(len, ws, Rank(r));
                        self.dtoh(OpKind::AllGather, b, r * m, &mut output.bytes_mut()[sh.start * esz..sh.end * esz])?;
                    }
                    Ok(())
                },
            )
        })
    }

    fn reduce_scatter(&self, input: BufRef<'_>, mut output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let (d, len) = (input.dtype(), input.len());
        let esz = d.size_bytes();
        let ws = self.world_size();
        validate::reduce_scatter(self.rank(), ws, &input, &output)?;
        if len == 0 {
            return Ok(());
        }
        let m = self.max_shard(len);
        self.staged(m * esz * self.size, m * esz, |a, b| {
            // Padding stays zero: the padded tails are never read back.
            for r in 0..self.size {
                let sh = shard_range(len, ws, Rank(r));
                self.htod(OpKind::ReduceScatter, &input.bytes()[sh.start * esz..sh.end * esz], a, r * m * esz)?;
            }
            let (pa, pb) = (self.ptr(a), self.ptr(b));
            self.op(
                OpKind::ReduceScatter,
                |c, s| check(unsafe { nc::ncclReduceScatter(pa as _, pb as _, m, nccl_type(d), nccl_op(op, true), c, s) }),
                || self.dtoh(OpKind::ReduceScatter, b, 0, output.bytes_mut()),
            )
        })?;
        finish_avg(d, op, output.bytes_mut(), self.size);
        Ok(())
    }

    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], mut output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError> {
        let n = self.size;
        validate::all_to_all(self.rank(), self.world_size(), &input, send_counts, &output, recv_counts)?;
        let esz = input.dtype().size_bytes();
        let offs = |c: &[usize]| {
            c.iter()
                .scan(0usize, |s, x| {
                    let o = *s;
                    *s += x;
                    Some(o * esz)
                })
                .collect::<Vec<_>>()
        };
        let (so, ro) = (offs(send_counts), offs(recv_counts));
        self.staged(input.bytes().len(), output.bytes().len(), |a, b| {
            self.htod(OpKind::AllToAll, input.bytes(), a, 0)?;
            let (pa, pb) = (self.ptr(a), self.ptr(b));
            let me = self.rank;
            self.op(
                OpKind::AllToAll,
                |c, s| unsafe {
                    check(nc::ncclGroupStart())?;
                    for j in 0..n {
                        if j == me {
                            continue;
                        }
                        if send_counts[j] > 0 {
                            check(nc::ncclSend((pa + so[j]) as _, send_counts[j] * esz, nc::ncclDataType_t::ncclUint8, j as i32, c, s))?;
                        }
                        if recv_counts[j] > 0 {
                            check(nc::ncclRecv((pb + ro[j]) as _, recv_counts[j] * esz, nc::ncclDataType_t::ncclUint8, j as i32, c, s))?;
                        }
                    }
                    check(nc::ncclGroupEnd())
                },
                || {
                    for j in 0..n {
                        if j != me {
                            self.dtoh(OpKind::AllToAll, b, ro[j], &mut output.bytes_mut()[ro[j]..ro[j] + recv_counts[j] * esz])?;
                        }
                    }
                    Ok(())
                },
            )
        })?;
        // This rank's own block never leaves the host.
        let k = send_counts[self.rank] * esz;
        output.bytes_mut()[ro[self.rank]..ro[self.rank] + k].copy_from_slice(&input.bytes()[so[self.rank]..so[self.rank] + k]);
        Ok(())
    }

    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        self.send_recv_impl(Some((buf, peer, tag)), None)
    }

    fn recv(&self, buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        self.send_recv_impl(None, Some((buf, peer, tag)))
    }

    fn send_recv(&self, send: BufRef<'_>, to: Rank, send_tag: u32, recv: BufMut<'_>, from: Rank, recv_tag: u32) -> Result<(), CommError> {
        self.send_recv_impl(Some((send, to, send_tag)), Some((recv, from, recv_tag)))
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0u8; 1];
        self.all_reduce(BufMut::from(&mut one[..]), ReduceOp::Max)
    }

    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        let op = OpKind::NewGroup;
        validate::group(self.rank(), self.world_size(), ranks)?;
        let pos = ranks.iter().position(|r| r.get() == self.rank);
        // Every rank agrees on the member list first (ncclCommSplit would hang on a mismatch).
        let mut mine = vec![0i64; ranks.len() + 1];
        mine[0] = ranks.len() as i64;
        for (d, r) in mine[1..].iter_mut().zip(ranks) {
            *d = r.get() as i64;
        }
        let mut max = mine.clone();
        self.all_reduce(BufMut::from(&mut max[..]), ReduceOp::Max)?;
        let mut min = mine.clone();
        self.all_reduce(BufMut::from(&mut min[..]), ReduceOp::Min)?;
        if max != mine || min != mine {
            return Err(self.bad(op, format!("ranks disagree on the group's members: this rank passed {ranks:?}")));
        }
        let (color, key) = match pos {
            Some(i) => (0, i as i32),
            None => (-1, 0), // NCCL_SPLIT_NOCOLOR
        };
        let h = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        self.ctx.bind_to_thread().map_err(|e| self.cuda_err(op, format!("{e:?}")))?;
        let mut c: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the handle is live; a null config means defaults (blocking).
        let st = unsafe { nc::ncclCommSplit(h.0, color, key, &mut c, std::ptr::null_mut()) };
        drop(h);
        if st != nc::ncclResult_t::ncclSuccess {
            return Err(self.cuda_err(op, format!("ncclCommSplit: {}", nccl_text(st, None))));
        }
        if pos.is_none() {
            return Ok(None);
        }
        let stream = self.ctx.new_stream().map_err(|e| self.cuda_err(op, format!("{e:?}")))?;
        Ok(Some(Arc::new(NcclComm::wrap(Handle(c), self.ctx.clone(), stream, pos.unwrap_or(0), ranks.len(), self.timeout()))))
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
    }
}

impl NcclComm {
    /// Point to point in one NCCL group: a header (tag, length) then the payload each way, so
    /// that two ranks exchanging never wait on each other and a mismatch is named afterwards.
    fn send_recv_impl(&self, send: Option<(BufRef<'_>, Rank, u32)>, recv: Option<(BufMut<'_>, Rank, u32)>) -> Result<(), CommError> {
        let op = if send.is_some() { OpKind::Send } else { OpKind::Recv };
        for peer in send.as_ref().map(|s| s.1).into_iter().chain(recv.as_ref().map(|r| r.1)) {
            validate::peer(op, self.rank(), self.world_size(), peer)?;
        }
        let sn = send.as_ref().map_or(0, |s| s.0.bytes().len());
        let rn = recv.as_ref().map_or(0, |r| r.0.bytes().len());
        let mut recv = recv;
        self.staged(HEADER + sn, HEADER + rn, |a, b| {
            if let Some((buf, _, tag)) = &send {
                self.htod(op, &header(*tag, buf.bytes().len()), a, 0)?;
                self.htod(op, buf.bytes(), a, HEADER)?;
            }
            let (pa, pb) = (self.ptr(a), self.ptr(b));
            let (to, from) = (send.as_ref().map(|s| s.1.get() as i32), recv.as_ref().map(|r| r.1.get() as i32));
            self.op(
                op,
                |c, s| unsafe {
                    let u8t = nc::ncclDataType_t::ncclUint8;
                    check(nc::ncclGroupStart())?;
                    if let Some(to) = to {
                        check(nc::ncclSend(pa as _, HEADER, u8t, to, c, s))?;
                        if sn > 0 {
                            check(nc::ncclSend((pa + HEADER) as _, sn, u8t, to, c, s))?;
                        }
                    }
                    if let Some(from) = from {
                        check(nc::ncclRecv(pb as _, HEADER, u8t, from, c, s))?;
                        if rn > 0 {
                            check(nc::ncclRecv((pb + HEADER) as _, rn, u8t, from, c, s))?;
                        }
                    }
                    check(nc::ncclGroupEnd())
                },
                || {
                    if let Some((buf, peer, tag)) = recv.as_mut() {
                        let mut h = [0u8; HEADER];
                        self.dtoh(OpKind::Recv, b, 0, &mut h)?;
                        if h != header(*tag, rn) {
                            let got_tag = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
                            let got_len = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
                            return Err(CommError::Mismatch {
                                op: OpKind::Recv,
                                rank: Rank(self.rank),
                                seq: self.seq.load(Ordering::Relaxed),
                                peer: *peer,
                                ours: format!("recv(tag {tag}, {rn} bytes)"),
                                theirs: format!("send(tag {got_tag}, {got_len} bytes)"),
                            });
                        }
                        self.dtoh(OpKind::Recv, b, HEADER, buf.bytes_mut())?;
                    }
                    Ok(())
                },
            )
        })
    }
}
