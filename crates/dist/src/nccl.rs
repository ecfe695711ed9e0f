//! The GPU path: NCCL's all-reduce on a CUDA device, as PyTorch DDP runs it.
//! The communicator's id is made by rank 0 and handed out over the
//! rendezvous's sockets (as torch's `TCPStore` hands it out). NCCL's ring
//! does the reduction over NVLink, PCIe or the network.
//!
//! Two ways in: values on the host ([`Nccl::all_reduce`] and the others),
//! copied to the device and back; and a buffer already on the device
//! ([`Nccl::all_reduce_device`], the gradients of a CUDA run, reduced in
//! place; [`Nccl::reduce_scatter_device`] and [`Nccl::all_gather_device`],
//! ZeRO's gradients and weights), queued after the work of the stream that
//! wrote it and before that stream's next work, with no copy and no wait on
//! the host — DDP's way, its collectives on a stream of their own.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use crate::{DistError, Group, Reduce};

/// A rank's NCCL communicator on its device.
pub(crate) struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    /// `ncclGetVersion`: 22703 for 2.27.3.
    pub(crate) version: i32,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("version", &self.version)
            .finish()
    }
}

// SAFETY: a communicator may be used from any thread, one call at a time;
// the group keeps it behind a mutex.
unsafe impl Send for Nccl {}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::Nccl(format!("{what}: {e:?}"))
}

impl Nccl {
    /// Every rank of `group` together: rank 0 makes the id, the group's
    /// sockets hand it out, each rank joins on CUDA device `ordinal`.
    pub(crate) fn connect(group: &Group, ordinal: usize) -> Result<Self, DistError> {
        // SAFETY: only tries to open the library by cudarc's names.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            let env = crate::process_env();
            let found = crate::nccl_lib::find_soname(&crate::nccl_lib::search_dirs(&env));
            return Err(DistError::Nccl(crate::nccl_lib::missing_advice(
                found.as_deref(),
            )));
        }
        let version = cudarc::nccl::result::get_nccl_version()
            .map_err(|e| nccl_error("ncclGetVersion", e))?;
        let id = if group.is_root() {
            let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let all = group.all_gather(&id)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (dst, src) in internal.iter_mut().zip(&all[0]) {
            *dst = *src as std::ffi::c_char;
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            DistError::Nccl(format!("opening CUDA device {ordinal} (LOCAL_RANK): {e}"))
        })?;
        let stream = ctx
            .new_stream()
            .map_err(|e| DistError::Nccl(format!("a CUDA stream on device {ordinal}: {e}")))?;
        let comm = Comm::from_rank(
            Arc::clone(&stream),
            group.rank(),
            group.world_size(),
            Id::uninit(internal),
        )
        .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(Self {
            comm,
            stream,
            version,
        })
    }

    /// `values` reduced across the ranks by NCCL, in place.
    pub(crate) fn all_reduce(&self, values: &mut [f32], op: Reduce) -> Result<(), DistError> {
        self.reduce(values, op)
    }

    /// `values` sent and reduced by NCCL as bfloat16 (`ncclBfloat16`),
    /// the result widened back to f32.
    pub(crate) fn all_reduce_bf16(&self, values: &mut [f32], op: Reduce) -> Result<(), DistError> {
        let mut narrow: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
        self.reduce(&mut narrow, op)?;
        for (v, n) in values.iter_mut().zip(&narrow) {
            *v = n.to_f32();
        }
        Ok(())
    }

    /// Every rank's `mine` (rank `r` has `counts[r]` values), concatenated
    /// in rank order: `ncclAllGather` over equal slices, each padded to
    /// the largest.
    pub(crate) fn all_gather(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError> {
        let widest = counts.iter().copied().max().unwrap_or(0);
        if widest == 0 {
            return Ok(Vec::new());
        }
        let cuda = |what: &str, e: cudarc::driver::DriverError| {
            DistError::Nccl(format!("{what} of {widest} values a rank: {e}"))
        };
        let mut padded = mine.to_vec();
        padded.resize(widest, 0.0);
        let send = self
            .stream
            .clone_htod(&padded)
            .map_err(|e| cuda("copying to the device", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<f32>(widest * counts.len())
            .map_err(|e| cuda("allocating the all-gather", e))?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(|e| nccl_error("ncclAllGather", e))?;
        let mut all = vec![0f32; widest * counts.len()];
        self.stream
            .memcpy_dtoh(&recv, &mut all)
            .map_err(|e| cuda("copying back", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda("waiting for the all-gather", e))?;
        Ok(counts
            .iter()
            .enumerate()
            .flat_map(|(r, &n)| all[r * widest..r * widest + n].iter().copied())
            .collect())
    }

    /// This rank's part of `values` (every rank's part in rank order,
    /// `counts` of them) reduced by `ncclReduceScatter`, over parts each
    /// padded to the largest; as bfloat16 (`ncclBfloat16`) with `bf16`,
    /// the part widened back to f32.
    pub(crate) fn reduce_scatter(
        &self,
        values: &[f32],
        counts: &[usize],
        op: Reduce,
        bf16: bool,
    ) -> Result<Vec<f32>, DistError> {
        if bf16 {
            self.scatter_as(values, counts, op, half::bf16::from_f32, half::bf16::to_f32)
        } else {
            self.scatter_as(values, counts, op, |v| v, |v| v)
        }
    }

    fn scatter_as<T>(
        &self,
        values: &[f32],
        counts: &[usize],
        op: Reduce,
        narrow: impl Fn(f32) -> T,
        widen: impl Fn(T) -> f32,
    ) -> Result<Vec<f32>, DistError>
    where
        T: cudarc::nccl::NcclType
            + cudarc::driver::DeviceRepr
            + cudarc::driver::ValidAsZeroBits
            + Copy
            + Default,
    {
        let widest = counts.iter().copied().max().unwrap_or(0);
        if widest == 0 {
            return Ok(Vec::new());
        }
        let cuda = |what: &str, e: cudarc::driver::DriverError| {
            DistError::Nccl(format!("{what} of {widest} values a rank: {e}"))
        };
        let mut padded = vec![T::default(); widest * counts.len()];
        let mut from = 0;
        for (r, &n) in counts.iter().enumerate() {
            for (dst, &v) in padded[r * widest..r * widest + n]
                .iter_mut()
                .zip(&values[from..from + n])
            {
                *dst = narrow(v);
            }
            from += n;
        }
        let send = self
            .stream
            .clone_htod(&padded)
            .map_err(|e| cuda("copying to the device", e))?;
        drop(padded);
        let mut recv = self
            .stream
            .alloc_zeros::<T>(widest)
            .map_err(|e| cuda("allocating the reduce-scatter", e))?;
        self.comm
            .reduce_scatter(&send, &mut recv, &reduce_op(op))
            .map_err(|e| nccl_error("ncclReduceScatter", e))?;
        let mut mine = vec![T::default(); widest];
        self.stream
            .memcpy_dtoh(&recv, &mut mine)
            .map_err(|e| cuda("copying back", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda("waiting for the reduce-scatter", e))?;
        let rank = self.comm.rank();
        Ok(mine[..counts[rank]].iter().map(|&v| widen(v)).collect())
    }

    fn reduce<T>(&self, values: &mut [T], op: Reduce) -> Result<(), DistError>
    where
        T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr,
    {
        let n = values.len();
        let cuda = |what: &str, e: cudarc::driver::DriverError| {
            DistError::Nccl(format!("{what} of {n} values: {e}"))
        };
        let mut device = self
            .stream
            .clone_htod(&*values)
            .map_err(|e| cuda("copying to the device", e))?;
        self.comm
            .all_reduce_in_place(&mut device, &reduce_op(op))
            .map_err(|e| nccl_error("ncclAllReduce", e))?;
        self.stream
            .memcpy_dtoh(&device, values)
            .map_err(|e| cuda("copying back", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda("waiting for the all-reduce", e))
    }

    /// `buffer` reduced across the ranks in place, on the device, queued
    /// as [`ordered`](Self::ordered) says.
    ///
    /// # Safety
    /// `buffer.ptr` is live device memory of this communicator's device
    /// holding `buffer.len` values of `buffer.dtype`, not freed or reused
    /// before the work queued on `buffer.stream` after this call, and
    /// `buffer.stream` a live stream of that device's primary context.
    pub(crate) unsafe fn all_reduce_device(
        &self,
        buffer: &crate::DeviceBuffer,
        op: Reduce,
    ) -> Result<(), DistError> {
        let what = format!("{} values on the device", buffer.len);
        // SAFETY: the caller's promise, passed on.
        unsafe {
            self.ordered(buffer.stream, &what, || {
                let op = reduce_op(op);
                let status = match buffer.dtype {
                    crate::DeviceDtype::F32 => self
                        .comm
                        .all_reduce_in_place(&mut self.borrow::<f32>(buffer), &op),
                    crate::DeviceDtype::Bf16 => self
                        .comm
                        .all_reduce_in_place(&mut self.borrow::<half::bf16>(buffer), &op),
                };
                status
                    .map(|_| ())
                    .map_err(|e| nccl_error("ncclAllReduce", e))
            })
        }
    }

    /// `ncclReduceScatter` on the device: `send` holds every rank's part
    /// in rank order, each `recv.len` values; `recv` receives the
    /// reduction of this rank's part. Queued as [`ordered`](Self::ordered)
    /// says, on the stream the two buffers share.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device)'s, for each buffer.
    pub(crate) unsafe fn reduce_scatter_device(
        &self,
        send: &crate::DeviceBuffer,
        recv: &crate::DeviceBuffer,
        op: Reduce,
    ) -> Result<(), DistError> {
        self.check_pair("reduce-scatter", send, recv, send.len)?;
        let what = format!("{} values a rank on the device", recv.len);
        // SAFETY: the caller's promise, passed on.
        unsafe {
            self.ordered(send.stream, &what, || {
                let op = reduce_op(op);
                let status = match send.dtype {
                    crate::DeviceDtype::F32 => self.comm.reduce_scatter(
                        &self.borrow::<f32>(send),
                        &mut self.borrow::<f32>(recv),
                        &op,
                    ),
                    crate::DeviceDtype::Bf16 => self.comm.reduce_scatter(
                        &self.borrow::<half::bf16>(send),
                        &mut self.borrow::<half::bf16>(recv),
                        &op,
                    ),
                };
                status
                    .map(|_| ())
                    .map_err(|e| nccl_error("ncclReduceScatter", e))
            })
        }
    }

    /// `ncclAllGather` on the device: every rank's `send` (as many values
    /// on each) laid end to end in rank order into `recv`. Queued as
    /// [`ordered`](Self::ordered) says, on the stream the two buffers
    /// share.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device)'s, for each buffer.
    pub(crate) unsafe fn all_gather_device(
        &self,
        send: &crate::DeviceBuffer,
        recv: &crate::DeviceBuffer,
    ) -> Result<(), DistError> {
        self.check_pair("all-gather", send, recv, recv.len)?;
        let what = format!("{} values a rank on the device", send.len);
        // SAFETY: the caller's promise, passed on.
        unsafe {
            self.ordered(send.stream, &what, || {
                let status = match send.dtype {
                    crate::DeviceDtype::F32 => self
                        .comm
                        .all_gather(&self.borrow::<f32>(send), &mut self.borrow::<f32>(recv)),
                    crate::DeviceDtype::Bf16 => self.comm.all_gather(
                        &self.borrow::<half::bf16>(send),
                        &mut self.borrow::<half::bf16>(recv),
                    ),
                };
                status
                    .map(|_| ())
                    .map_err(|e| nccl_error("ncclAllGather", e))
            })
        }
    }

    /// Refuses a pair of buffers a collective cannot take, before anything
    /// is queued: another dtype or stream, or a `whole` (the buffer that
    /// holds every rank's part) that is not the ranks' parts end to end.
    fn check_pair(
        &self,
        what: &str,
        send: &crate::DeviceBuffer,
        recv: &crate::DeviceBuffer,
        whole: usize,
    ) -> Result<(), DistError> {
        let world = self.comm.world_size();
        let part = send.len.min(recv.len);
        if send.dtype != recv.dtype || send.stream != recv.stream || part * world != whole {
            return Err(DistError::Nccl(format!(
                "a {what} on the device of {} {:?} values into {} {:?} values over {world} ranks: \
                 the buffers must share a dtype and a stream, the larger holding {world} parts",
                send.len, send.dtype, recv.len, recv.dtype
            )));
        }
        Ok(())
    }

    /// `call` (collectives queued on NCCL's stream) ordered on the device
    /// between the work of `theirs` (the stream of the buffers' owner):
    /// NCCL's stream waits for what `theirs` queued so far (what wrote the
    /// values), and `theirs` waits for the collectives before its next
    /// work. Nothing waits on the host. `what` names the values in errors.
    ///
    /// # Safety
    /// `theirs` is a live stream of this communicator's device's primary
    /// context.
    unsafe fn ordered(
        &self,
        theirs: *mut std::ffi::c_void,
        what: &str,
        call: impl FnOnce() -> Result<(), DistError>,
    ) -> Result<(), DistError> {
        use cudarc::driver::result::{event, stream};
        use cudarc::driver::sys::{CUevent_flags, CUevent_wait_flags, CUstream};
        let cuda = |doing: &str, e: cudarc::driver::DriverError| {
            DistError::Nccl(format!("{doing} ({what}): {e}"))
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda("binding the device's context", e))?;
        let theirs = theirs as CUstream;
        let ours = self.stream.cu_stream();
        let make = || {
            event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda("an event to order the collective", e))
        };
        let (written, done) = (make()?, make()?);
        // SAFETY: live events of this context on live streams of it (the
        // caller's promise for `theirs`); an event may be destroyed once
        // recorded and waited on, CUDA releasing it when it completes.
        unsafe {
            let before = event::record(written, theirs)
                .and_then(|()| {
                    stream::wait_event(ours, written, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                })
                .map_err(|e| cuda("ordering the collective after the values' writers", e));
            let after = before.and_then(|()| call()).and_then(|()| {
                event::record(done, ours)
                    .and_then(|()| {
                        stream::wait_event(theirs, done, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    })
                    .map_err(|e| cuda("ordering the values' readers after the collective", e))
            });
            let _ = event::destroy(written);
            let _ = event::destroy(done);
            after
        }
    }

    /// `buffer`'s values as `T`, lent to NCCL on its stream for one call.
    fn borrow<T>(&self, buffer: &crate::DeviceBuffer) -> Borrowed<'_, T> {
        Borrowed {
            ptr: buffer.ptr,
            len: buffer.len,
            stream: &self.stream,
            of: std::marker::PhantomData,
        }
    }
}

/// Device memory that is not cudarc's (a CubeCL buffer), lent to NCCL for
/// one call: no ordering of its own, [`Nccl::ordered`] orders it with
/// events.
struct Borrowed<'a, T> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    of: std::marker::PhantomData<T>,
}

impl<T> cudarc::driver::DeviceSlice<T> for Borrowed<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> cudarc::driver::DevicePtr<T> for Borrowed<'_, T> {
    fn device_ptr<'a>(
        &'a self,
        _stream: &'a CudaStream,
    ) -> (
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::SyncOnDrop<'a>,
    ) {
        (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

impl<T> cudarc::driver::DevicePtrMut<T> for Borrowed<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::SyncOnDrop<'a>,
    ) {
        (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
    }
}

fn reduce_op(op: Reduce) -> ReduceOp {
    match op {
        Reduce::Sum => ReduceOp::Sum,
        Reduce::Mean => ReduceOp::Avg,
        Reduce::Max => ReduceOp::Max,
    }
}
