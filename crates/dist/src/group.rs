//! The connected job: a rendezvous that rank 0 hosts at
//! `MASTER_ADDR:MASTER_PORT` (as torch's `TCPStore`), then a star of
//! sockets through rank 0 for the collectives. Rank 0 reduces in rank order
//! and sends every rank the same bytes, so a job is deterministic for a
//! given world size, and a resumed job repeats an uninterrupted one.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{DistError, WorldSpec};

const MAGIC: u32 = 0x4b49_4c4e; // "KILN"
const VERSION: u32 = 1;
const OP_REDUCE: u8 = 1;
const OP_GATHER: u8 = 2;
const OP_REDUCE_BF16: u8 = 3;
const OP_GATHER_F32: u8 = 4;
const OP_GATHER_ROOT: u8 = 5;
const OP_REDUCE_SCATTER: u8 = 6;
const OP_REDUCE_SCATTER_BF16: u8 = 7;

/// How an all-reduce combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The sum, in rank order.
    Sum,
    /// The sum divided by the world size (gradients, losses).
    Mean,
    /// The largest (flags: any rank).
    Max,
}

/// The type values travel in during an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    F32,
    /// bfloat16: half the bytes, 8 bits of mantissa.
    Bf16,
}

impl Wire {
    /// The operation's code: an all-reduce, or a reduce-scatter (`scatter`).
    fn op(self, scatter: bool) -> u8 {
        match (self, scatter) {
            (Wire::F32, false) => OP_REDUCE,
            (Wire::Bf16, false) => OP_REDUCE_BF16,
            (Wire::F32, true) => OP_REDUCE_SCATTER,
            (Wire::Bf16, true) => OP_REDUCE_SCATTER_BF16,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 => 2,
        }
    }

    fn encode(self, frame: &mut Vec<u8>, values: &[f32]) {
        match self {
            Wire::F32 => values
                .iter()
                .for_each(|v| frame.extend_from_slice(&v.to_le_bytes())),
            Wire::Bf16 => values.iter().for_each(|&v| {
                frame.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }),
        }
    }

    /// `v` as it arrives after travelling.
    fn round(self, v: f32) -> f32 {
        match self {
            Wire::F32 => v,
            Wire::Bf16 => half::bf16::from_f32(v).to_f32(),
        }
    }

    fn decode(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Wire::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Wire::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }

    /// Reads `out.len()` values; f32 straight into `out` (their bytes on a
    /// little-endian machine are what travels), bf16 through a buffer.
    fn read(self, stream: &mut TcpStream, out: &mut [f32]) -> std::io::Result<()> {
        if self == Wire::F32 && cfg!(target_endian = "little") {
            return stream.read_exact(bytemuck::cast_slice_mut(out));
        }
        let mut bytes = vec![0u8; out.len() * self.bytes()];
        stream.read_exact(&mut bytes)?;
        self.decode(&bytes, out);
        Ok(())
    }

    /// `values` as they travel: f32 as their own bytes on a
    /// little-endian machine (no copy), else encoded into `buf`.
    fn as_bytes<'a>(self, values: &'a [f32], buf: &'a mut Vec<u8>) -> &'a [u8] {
        if self == Wire::F32 && cfg!(target_endian = "little") {
            return bytemuck::cast_slice(values);
        }
        buf.clear();
        self.encode(buf, values);
        buf
    }

    /// Sends `values` ([`Wire::as_bytes`]).
    fn write(self, stream: &mut TcpStream, values: &[f32]) -> std::io::Result<()> {
        stream.write_all(self.as_bytes(values, &mut Vec::new()))
    }
}

/// Another rank, as rank 0 sees it.
#[derive(Debug)]
struct Peer {
    rank: usize,
    host: String,
    stream: TcpStream,
}

/// A buffer on a CUDA device for [`Group::all_reduce_device`] (and
/// [`Group::reduce_scatter_device`], [`Group::all_gather_device`]): its
/// address, how many values it holds, their type, and the stream whose
/// work writes and reads it (a `CUstream`).
#[cfg(feature = "nccl")]
#[derive(Clone, Copy, Debug)]
pub struct DeviceBuffer {
    /// The device address of the first value (a `CUdeviceptr`).
    pub ptr: u64,
    /// How many values.
    pub len: usize,
    /// Their type.
    pub dtype: DeviceDtype,
    /// The stream the buffer's writers and readers are queued on.
    pub stream: *mut std::ffi::c_void,
}

/// The value types the collectives on the device take.
#[cfg(feature = "nccl")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceDtype {
    /// 32-bit floats (`ncclFloat32`).
    F32,
    /// bfloat16 (`ncclBfloat16`), summed by NCCL in bfloat16.
    Bf16,
}

#[derive(Debug)]
enum Links {
    /// Rank 0: a socket to every other rank, in rank order.
    Root(Vec<Peer>),
    /// The others: the socket to rank 0.
    Leaf { root: TcpStream, root_host: String },
}

/// A job's processes, connected. Collectives block until every rank has
/// called them; they fail, naming the rank, when one is gone or does not
/// answer within the group's timeout.
#[derive(Debug)]
pub struct Group {
    rank: usize,
    local_rank: usize,
    world: usize,
    timeout: Duration,
    links: Mutex<Links>,
    /// Set by [`Group::use_nccl`]: the all-reduce goes through NCCL.
    #[cfg(feature = "nccl")]
    nccl: Mutex<Option<crate::nccl::Nccl>>,
}

impl Group {
    /// Joins the job `spec` describes: rank 0 listens at its port and waits
    /// for every other rank; the others connect, retrying until rank 0
    /// listens. Fails after `timeout` naming who did not join. Collectives
    /// wait as long for a slow rank (`COLLECTIVE_TIMEOUT` seconds where set).
    pub fn connect(spec: &WorldSpec, timeout: Duration) -> Result<Self, DistError> {
        let op_timeout = std::env::var("COLLECTIVE_TIMEOUT")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(Duration::from_secs(600), Duration::from_secs);
        let links = if spec.rank == 0 {
            let (listener, spec) = listen(spec, timeout)?;
            Links::Root(accept_all(&spec, listener, timeout)?)
        } else {
            join(&rank_0_at(spec, timeout)?, timeout)?
        };
        let group = Self {
            rank: spec.rank,
            local_rank: spec.local_rank,
            world: spec.world_size,
            timeout: op_timeout,
            links: Mutex::new(links),
            #[cfg(feature = "nccl")]
            nccl: Mutex::new(None),
        };
        group.set_timeouts()?;
        Ok(group)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Its rank on this machine (the GPU it takes).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Processes in the job.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Whether this is rank 0, the one that writes.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    fn set_timeouts(&self) -> Result<(), DistError> {
        self.each_stream(|s| {
            s.set_read_timeout(Some(self.timeout))?;
            s.set_write_timeout(Some(self.timeout))?;
            s.set_nodelay(true)
        })
    }

    fn each_stream(&self, f: impl Fn(&TcpStream) -> std::io::Result<()>) -> Result<(), DistError> {
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let streams: Vec<&TcpStream> = match &*links {
            Links::Root(peers) => peers.iter().map(|p| &p.stream).collect(),
            Links::Leaf { root, .. } => vec![root],
        };
        for s in streams {
            f(s).map_err(|source| DistError::Io {
                what: "setting the job's sockets up".into(),
                source,
            })?;
        }
        Ok(())
    }

    /// From now on, reduces through NCCL on CUDA device `ordinal` (the
    /// engine of PyTorch DDP): every rank calls it together, after the
    /// rendezvous. Returns NCCL's version (`22703` for 2.27.3). Where
    /// `COLLECTIVES=sockets` is set, keeps the sockets and returns `None`.
    #[cfg(feature = "nccl")]
    pub fn use_nccl(&self, ordinal: usize) -> Result<Option<i32>, DistError> {
        if std::env::var("COLLECTIVES").is_ok_and(|v| v == "sockets") {
            return Ok(None);
        }
        let nccl = crate::nccl::Nccl::connect(self, ordinal)?;
        let version = nccl.version;
        *self.nccl.lock().unwrap_or_else(|e| e.into_inner()) = Some(nccl);
        Ok(Some(version))
    }

    /// Whether the collectives go through NCCL ([`use_nccl`](Self::use_nccl)
    /// found it and `COLLECTIVES=sockets` is unset): then
    /// [`all_reduce_device`](Self::all_reduce_device) takes values where
    /// they are, on the GPU.
    #[cfg(feature = "nccl")]
    pub fn uses_nccl(&self) -> bool {
        self.nccl
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// [`all_reduce`](Self::all_reduce) of values on this rank's CUDA
    /// device, in place, by NCCL (PyTorch DDP's way): no copy through the
    /// host, nothing waited for on the host. The all-reduce is queued after
    /// the work `buffer.stream` has queued so far and before its next, so
    /// a reader of the values queued on that stream after this call reads
    /// the result. An error where the group does not use NCCL.
    ///
    /// # Safety
    /// `buffer.ptr` is live memory of the device [`use_nccl`](Self::use_nccl)
    /// named, holding `buffer.len` values of `buffer.dtype`, neither freed
    /// nor reused before the work queued on `buffer.stream` after this call
    /// (an allocator that hands memory out in that stream's order keeps
    /// this where the buffer's owner outlives the call), and `buffer.stream`
    /// is a live stream of that device's primary context.
    #[cfg(feature = "nccl")]
    pub unsafe fn all_reduce_device(
        &self,
        buffer: &DeviceBuffer,
        op: Reduce,
    ) -> Result<(), DistError> {
        match &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: the caller's promise, passed on.
            Some(nccl) => unsafe { nccl.all_reduce_device(buffer, op) },
            None => Err(DistError::Nccl(
                "an all-reduce on the device was asked of a job that does not use NCCL".into(),
            )),
        }
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of values on this rank's
    /// CUDA device, by NCCL (`ncclReduceScatter`, ZeRO-2's gradients on the
    /// GPU): `send` holds every rank's part in rank order, each `recv.len`
    /// values (pad the parts to the largest), and `recv` receives the
    /// reduction of this rank's part. Queued after the work the buffers'
    /// stream has queued so far and before its next, as
    /// [`all_reduce_device`](Self::all_reduce_device) is; nothing waited
    /// for on the host. An error where the group does not use NCCL, or
    /// where the buffers differ in dtype or stream or `send` is not
    /// `world × recv.len` values.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device)'s, for each buffer.
    #[cfg(feature = "nccl")]
    pub unsafe fn reduce_scatter_device(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        op: Reduce,
    ) -> Result<(), DistError> {
        match &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: the caller's promise, passed on.
            Some(nccl) => unsafe { nccl.reduce_scatter_device(send, recv, op) },
            None => Err(DistError::Nccl(
                "a reduce-scatter on the device was asked of a job that does not use NCCL".into(),
            )),
        }
    }

    /// Every rank's `send` laid end to end in rank order into `recv`, on
    /// this rank's CUDA device, by NCCL (`ncclAllGather`, ZeRO's updated
    /// weights on the GPU): every rank sends as many values (pad them to
    /// the largest), `recv` holds `world × send.len`. Ordered as
    /// [`reduce_scatter_device`](Self::reduce_scatter_device) is, with its
    /// errors.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device)'s, for each buffer.
    #[cfg(feature = "nccl")]
    pub unsafe fn all_gather_device(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
    ) -> Result<(), DistError> {
        match &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: the caller's promise, passed on.
            Some(nccl) => unsafe { nccl.all_gather_device(send, recv) },
            None => Err(DistError::Nccl(
                "an all-gather on the device was asked of a job that does not use NCCL".into(),
            )),
        }
    }

    /// Combines `values` across the ranks; afterwards every rank holds the
    /// same result. Every rank must pass as many values.
    pub fn all_reduce(&self, values: &mut [f32], op: Reduce) -> Result<(), DistError> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            return nccl.all_reduce(values, op);
        }
        self.reduce_over_sockets(values, op, Wire::F32, None)
    }

    /// [`all_reduce`](Self::all_reduce) with the values sent as bfloat16,
    /// half the bytes (PyTorch DDP's `bf16_compress_hook`; FSDP's
    /// `reduce_dtype`): each rank's values are rounded to bf16, combined,
    /// and the result rounded to bf16 again, the same on every rank. Over
    /// the sockets rank 0 combines them in f32; NCCL combines them in bf16.
    pub fn all_reduce_bf16(&self, values: &mut [f32], op: Reduce) -> Result<(), DistError> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            return nccl.all_reduce_bf16(values, op);
        }
        self.reduce_over_sockets(values, op, Wire::Bf16, None)
    }

    /// [`all_reduce`](Self::all_reduce) of which each rank gets back only
    /// its part (ZeRO-2's gradients): `values` holds every rank's part in
    /// rank order, rank `r`'s `counts[r]` values, and every rank passes the
    /// same `counts`. Returns this rank's part of the result, the same bits
    /// as that part of an all-reduce of `values` (over the sockets; NCCL's
    /// `ncclReduceScatter` reduces in its own order). Half an all-reduce's
    /// traffic: what each rank receives is its part alone.
    pub fn reduce_scatter(
        &self,
        values: &mut [f32],
        counts: &[usize],
        op: Reduce,
    ) -> Result<Vec<f32>, DistError> {
        self.scatter(values, counts, op, Wire::F32)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with the values sent as
    /// bfloat16, rounded as [`all_reduce_bf16`](Self::all_reduce_bf16)
    /// rounds them.
    pub fn reduce_scatter_bf16(
        &self,
        values: &mut [f32],
        counts: &[usize],
        op: Reduce,
    ) -> Result<Vec<f32>, DistError> {
        self.scatter(values, counts, op, Wire::Bf16)
    }

    /// A reduce-scatter in `wire`: through NCCL where the group uses it,
    /// else rank 0's sockets.
    fn scatter(
        &self,
        values: &mut [f32],
        counts: &[usize],
        op: Reduce,
        wire: Wire,
    ) -> Result<Vec<f32>, DistError> {
        self.check_parts(values, counts)?;
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            return nccl.reduce_scatter(values, counts, op, wire == Wire::Bf16);
        }
        self.reduce_over_sockets(values, op, wire, Some(counts))?;
        Ok(self.part(values, counts).to_vec())
    }

    /// Refuses `counts` that are not one per rank adding up to `values`,
    /// before anything travels.
    fn check_parts(&self, values: &[f32], counts: &[usize]) -> Result<(), DistError> {
        if counts.len() != self.world || counts.iter().sum::<usize>() != values.len() {
            return Err(DistError::Diverged(format!(
                "rank {} reduce-scatters {} values in parts of {counts:?} over {} ranks",
                self.rank,
                values.len(),
                self.world
            )));
        }
        Ok(())
    }

    /// This rank's part of `values`, laid out as `counts` says.
    fn part<'a>(&self, values: &'a [f32], counts: &[usize]) -> &'a [f32] {
        let start: usize = counts[..self.rank].iter().sum();
        &values[start..start + counts[self.rank]]
    }

    /// Rank 0 combines every rank's `values` in rank order and sends each
    /// rank the result: all of it, or with `parts` (a reduce-scatter) the
    /// rank's part alone, the one part of its `values` to read afterwards
    /// (the rest is left as it was, or on rank 0 as combined).
    fn reduce_over_sockets(
        &self,
        values: &mut [f32],
        op: Reduce,
        wire: Wire,
        parts: Option<&[usize]>,
    ) -> Result<(), DistError> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let during = if parts.is_some() {
            "the reduce-scatter"
        } else {
            "the all-reduce"
        };
        let code = wire.op(parts.is_some());
        // Where each rank's part of the result starts, and its length.
        let len = values.len();
        let part = |rank: usize| match parts {
            Some(counts) => (counts[..rank].iter().sum(), counts[rank]),
            None => (0, len),
        };
        match &mut *links {
            Links::Leaf { root, root_host } => {
                let lost = |why: String| lost(0, root_host, during, why);
                root.write_all(&header(code, op as u8, values.len()))
                    .map_err(|e| lost(io_why(&e)))?;
                wire.write(root, values).map_err(|e| lost(io_why(&e)))?;
                let (start, n) = part(self.rank);
                wire.read(root, &mut values[start..start + n])
                    .map_err(|e| lost(io_why(&e)))?;
            }
            Links::Root(peers) => {
                // Rank 0 combines in place, from its own values as they
                // would travel (a world of one: its values as they are,
                // nothing allocated, nothing copied).
                let acc = values;
                if wire == Wire::Bf16 {
                    acc.iter_mut().for_each(|a| *a = wire.round(*a));
                }
                let mut theirs = if peers.is_empty() {
                    Vec::new()
                } else {
                    vec![0f32; acc.len()]
                };
                for p in peers.iter_mut() {
                    let header = read_header(&mut p.stream, code)
                        .map_err(|e| lost(p.rank, &p.host, during, io_why(&e)))?;
                    let (their_op, n) = header;
                    if their_op != op as u8 || n != acc.len() as u64 {
                        return Err(DistError::Diverged(format!(
                            "rank {} reduces {n} values (operation {their_op}), rank 0 {} (operation {})",
                            p.rank,
                            acc.len(),
                            op as u8
                        )));
                    }
                    wire.read(&mut p.stream, &mut theirs)
                        .map_err(|e| lost(p.rank, &p.host, during, io_why(&e)))?;
                    match op {
                        Reduce::Sum | Reduce::Mean => {
                            acc.iter_mut().zip(&theirs).for_each(|(a, b)| *a += b)
                        }
                        Reduce::Max => acc
                            .iter_mut()
                            .zip(&theirs)
                            .for_each(|(a, b)| *a = a.max(*b)),
                    }
                }
                if op == Reduce::Mean && self.world > 1 {
                    let n = self.world as f32;
                    acc.iter_mut().for_each(|a| *a /= n);
                }
                let mut buf = Vec::new();
                let send = |p: &mut Peer, frame: &[u8]| {
                    p.stream
                        .write_all(frame)
                        .map_err(|e| lost(p.rank, &p.host, during, io_why(&e)))
                };
                if parts.is_none() {
                    // Encoded once for every peer.
                    let frame = wire.as_bytes(acc, &mut buf);
                    for p in peers.iter_mut() {
                        send(p, frame)?;
                    }
                } else {
                    for p in peers.iter_mut() {
                        let (start, n) = part(p.rank);
                        send(p, wire.as_bytes(&acc[start..start + n], &mut buf))?;
                    }
                }
                // What the others decode (in bf16, the sum rounded again;
                // the other ranks' parts stay as combined, unread).
                if wire == Wire::Bf16 {
                    let (start, n) = part(0);
                    acc[start..start + n]
                        .iter_mut()
                        .for_each(|a| *a = wire.round(*a));
                }
            }
        }
        Ok(())
    }

    /// Every rank's `mine`, concatenated in rank order, on every rank:
    /// rank `r` passes `counts[r]` values, and every rank passes the same
    /// `counts` (ZeRO's updated weights, each rank's slice of the model).
    /// Through NCCL where the group uses it, else the sockets; the values
    /// arrive bit for bit.
    pub fn all_gather_f32(&self, mine: &[f32], counts: &[usize]) -> Result<Vec<f32>, DistError> {
        if counts.len() != self.world || counts[self.rank] != mine.len() {
            return Err(DistError::Diverged(format!(
                "rank {} gathers {} values as its share of {counts:?} over {} ranks",
                self.rank,
                mine.len(),
                self.world
            )));
        }
        #[cfg(feature = "nccl")]
        if let Some(nccl) = &*self.nccl.lock().unwrap_or_else(|e| e.into_inner()) {
            return nccl.all_gather(mine, counts);
        }
        let total: usize = counts.iter().sum();
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let during = "the all-gather of the weights";
        match &mut *links {
            Links::Leaf { root, root_host } => {
                let lost = |why: String| lost(0, root_host, during, why);
                root.write_all(&header(OP_GATHER_F32, 0, mine.len()))
                    .map_err(|e| lost(io_why(&e)))?;
                Wire::F32.write(root, mine).map_err(|e| lost(io_why(&e)))?;
                let mut all = vec![0f32; total];
                Wire::F32
                    .read(root, &mut all)
                    .map_err(|e| lost(io_why(&e)))?;
                Ok(all)
            }
            Links::Root(peers) => {
                let mut all = Vec::with_capacity(total);
                all.extend_from_slice(mine);
                for p in peers.iter_mut() {
                    let lost = |e: std::io::Error| lost(p.rank, &p.host, during, io_why(&e));
                    let (_, n) = read_header(&mut p.stream, OP_GATHER_F32).map_err(lost)?;
                    if n != counts[p.rank] as u64 {
                        return Err(DistError::Diverged(format!(
                            "rank {} sends {n} values to the all-gather, rank 0 expects {}",
                            p.rank, counts[p.rank]
                        )));
                    }
                    let from = all.len();
                    all.resize(from + counts[p.rank], 0.0);
                    Wire::F32
                        .read(&mut p.stream, &mut all[from..])
                        .map_err(lost)?;
                }
                for p in peers.iter_mut() {
                    Wire::F32
                        .write(&mut p.stream, &all)
                        .map_err(|e| lost(p.rank, &p.host, during, io_why(&e)))?;
                }
                Ok(all)
            }
        }
    }

    /// Every rank's `bytes`, in rank order, at rank 0 only (`None` on the
    /// others): what a checkpoint needs of each rank's share, without a
    /// copy of everything on every rank. Always over the sockets.
    pub fn gather_to_root(&self, bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>, DistError> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        gather_at_root(&mut links, OP_GATHER_ROOT, bytes, "a gather to rank 0")
    }

    /// Every rank's `bytes`, in rank order, on every rank.
    pub fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let during = "an all-gather";
        let gathered = gather_at_root(&mut links, OP_GATHER, bytes, during)?;
        match (&mut *links, gathered) {
            (Links::Root(peers), Some(all)) => {
                let mut frame = Vec::new();
                for b in &all {
                    frame.extend_from_slice(&(b.len() as u64).to_le_bytes());
                    frame.extend_from_slice(b);
                }
                for p in peers.iter_mut() {
                    p.stream
                        .write_all(&frame)
                        .map_err(|e| lost(p.rank, &p.host, during, io_why(&e)))?;
                }
                Ok(all)
            }
            (Links::Leaf { root, root_host }, _) => {
                read_gathered(root, self.world).map_err(|e| lost(0, root_host, during, io_why(&e)))
            }
            (Links::Root(_), None) => Ok(Vec::new()),
        }
    }

    /// Waits until every rank has called it, up to `timeout` instead of the
    /// group's (rank 0 preparing a corpus the others then read: longer
    /// than any step). A rank that dies still ends the wait at once.
    pub fn barrier(&self, timeout: Duration) -> Result<(), DistError> {
        self.with_timeout(timeout)?;
        let waited = self.all_gather(&[]);
        self.with_timeout(self.timeout)?;
        waited.map(|_| ())
    }

    fn with_timeout(&self, timeout: Duration) -> Result<(), DistError> {
        self.each_stream(|s| s.set_read_timeout(Some(timeout)))
    }

    /// Fails unless every rank passes the same `value` (a checksum of the
    /// weights, say), naming the ranks that differ from rank 0.
    pub fn check_same(&self, value: u64, what: &str) -> Result<(), DistError> {
        let all = self.all_gather(&value.to_le_bytes())?;
        let values: Vec<u64> = all
            .iter()
            .map(|b| b.as_slice().try_into().map_or(u64::MAX, u64::from_le_bytes))
            .collect();
        let differ: Vec<String> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| **v != values[0])
            .map(|(r, v)| format!("rank {r} has {v:016x}"))
            .collect();
        if differ.is_empty() {
            Ok(())
        } else {
            Err(DistError::Diverged(format!(
                "{what}: rank 0 has {:016x}, {}",
                values[0],
                differ.join(", ")
            )))
        }
    }
}

fn lost(rank: usize, host: &str, during: &str, why: String) -> DistError {
    DistError::PeerLost {
        rank,
        host: host.to_string(),
        during: during.to_string(),
        why,
    }
}

fn io_why(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => {
            "its connection closed (the process ended: killed, out of memory, or failed)".into()
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "no answer within the timeout (COLLECTIVE_TIMEOUT); it hangs or is far slower".into()
        }
        _ => e.to_string(),
    }
}

/// Every rank sends `bytes` under `op`; rank 0 gets them all in rank
/// order, the others `None`.
fn gather_at_root(
    links: &mut Links,
    op: u8,
    bytes: &[u8],
    during: &str,
) -> Result<Option<Vec<Vec<u8>>>, DistError> {
    match links {
        Links::Leaf { root, root_host } => {
            let mut frame = header(op, 0, bytes.len()).to_vec();
            frame.extend_from_slice(bytes);
            root.write_all(&frame)
                .map_err(|e| lost(0, root_host, during, io_why(&e)))?;
            Ok(None)
        }
        Links::Root(peers) => {
            let mut all = vec![bytes.to_vec()];
            for p in peers.iter_mut() {
                let lost = |e: std::io::Error| lost(p.rank, &p.host, during, io_why(&e));
                let (_, n) = read_header(&mut p.stream, op).map_err(lost)?;
                let mut theirs = vec![0u8; n as usize];
                p.stream.read_exact(&mut theirs).map_err(lost)?;
                all.push(theirs);
            }
            Ok(Some(all))
        }
    }
}

/// A collective's frame header, as [`read_header`] reads it: the
/// operation, its argument (a [`Reduce`]), and how many values or bytes
/// follow.
fn header(op: u8, arg: u8, n: usize) -> [u8; 10] {
    let mut h = [0u8; 10];
    h[0] = op;
    h[1] = arg;
    h[2..].copy_from_slice(&(n as u64).to_le_bytes());
    h
}

fn read_header(stream: &mut TcpStream, expect: u8) -> std::io::Result<(u8, u64)> {
    let mut h = [0u8; 10];
    stream.read_exact(&mut h)?;
    if h[0] != expect {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "it called another collective (operation {}, this rank {expect}): the ranks are out of step",
                h[0]
            ),
        ));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&h[2..]);
    Ok((h[1], u64::from_le_bytes(n)))
}

fn read_gathered(stream: &mut TcpStream, world: usize) -> std::io::Result<Vec<Vec<u8>>> {
    (0..world)
        .map(|_| {
            let mut n = [0u8; 8];
            stream.read_exact(&mut n)?;
            let mut b = vec![0u8; u64::from_le_bytes(n) as usize];
            stream.read_exact(&mut b)?;
            Ok(b)
        })
        .collect()
}

/// The hello a rank sends: magic, version, rank, world, pid, host.
fn hello(spec: &WorldSpec) -> Vec<u8> {
    let host = crate::hostname();
    let mut b = Vec::new();
    for v in [
        MAGIC,
        VERSION,
        spec.rank as u32,
        spec.world_size as u32,
        std::process::id(),
    ] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&(host.len() as u16).to_le_bytes());
    b.extend_from_slice(host.as_bytes());
    b
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Rank 0's listener for the rendezvous, and the spec with the port it
/// listens at: `MASTER_PORT`, or under torchrun's agent store a free port,
/// written into that store for the other ranks ([`rank_0_at`]).
fn listen(spec: &WorldSpec, timeout: Duration) -> Result<(TcpListener, WorldSpec), DistError> {
    let port = if spec.torchrun_store_key.is_some() {
        0
    } else {
        spec.master_port
    };
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|source| {
        if source.kind() == std::io::ErrorKind::AddrInUse {
            DistError::PortInUse { port }
        } else {
            DistError::Io {
                what: format!("listening at port {port}"),
                source,
            }
        }
    })?;
    let Some(key) = &spec.torchrun_store_key else {
        return Ok((listener, spec.clone()));
    };
    let port = listener
        .local_addr()
        .map_err(|source| DistError::Io {
            what: "listening".into(),
            source,
        })?
        .port();
    crate::store::Store::connect(&spec.master_addr, spec.master_port, timeout)?
        .set(key, port.to_string().as_bytes())?;
    Ok((listener, spec.at_port(port)))
}

/// Where the other ranks find rank 0: `MASTER_ADDR:MASTER_PORT`, or under
/// torchrun's agent store `MASTER_ADDR` at the port rank 0 wrote there.
fn rank_0_at(spec: &WorldSpec, timeout: Duration) -> Result<WorldSpec, DistError> {
    let Some(key) = &spec.torchrun_store_key else {
        return Ok(spec.clone());
    };
    let started = Instant::now();
    let mut store = crate::store::Store::connect(&spec.master_addr, spec.master_port, timeout)?;
    let left = timeout.saturating_sub(started.elapsed());
    let value = store
        .wait_get(key, left)?
        .ok_or_else(|| DistError::RendezvousTimeout {
            addr: format!("torchrun's store at {}", spec.addr()),
            missing: format!("rank 0 (which writes its port under `{key}`)"),
            waited: timeout,
            remedy: crate::error::STORE_PROTOCOL,
        })?;
    let text = String::from_utf8_lossy(&value);
    let port = text.parse::<u16>().map_err(|_| DistError::BadLaunch {
        what: format!("torchrun's store at {}", spec.addr()),
        why: format!("`{key}` holds `{text}`, not a port"),
    })?;
    Ok(spec.at_port(port))
}

/// A connection to `host:port`, tried again every 100 ms until `deadline`
/// (the other side may not listen yet); `None` if none was made by then.
/// A host that does not resolve is `MASTER_ADDR`'s error.
pub(crate) fn connect_until(
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<Option<TcpStream>, DistError> {
    loop {
        let addrs: Vec<_> = (host, port)
            .to_socket_addrs()
            .map_err(|e| DistError::BadLaunch {
                what: format!("MASTER_ADDR={host}"),
                why: format!("cannot be resolved: {e}"),
            })?
            .collect();
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).ok())
        {
            return Ok(Some(s));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Rank 0: takes every other rank's hello at `listener`, then tells each
/// that the job is complete (an empty reason) or why it is refused.
fn accept_all(
    spec: &WorldSpec,
    listener: TcpListener,
    timeout: Duration,
) -> Result<Vec<Peer>, DistError> {
    listener
        .set_nonblocking(true)
        .map_err(|source| DistError::Io {
            what: "listening".into(),
            source,
        })?;
    let started = Instant::now();
    let mut peers: Vec<Option<Peer>> = (1..spec.world_size).map(|_| None).collect();
    while peers.iter().any(Option::is_none) {
        if started.elapsed() > timeout {
            let missing: Vec<String> = peers
                .iter()
                .enumerate()
                .filter(|(_, p)| p.is_none())
                .map(|(i, _)| (i + 1).to_string())
                .collect();
            return Err(DistError::RendezvousTimeout {
                addr: spec.addr(),
                missing: format!("rank {}", missing.join(", ")),
                waited: timeout,
                remedy: crate::error::LAUNCHERS_AGREE,
            });
        }
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(source) => {
                return Err(DistError::Io {
                    what: "accepting a rank".into(),
                    source,
                });
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Ok(peer) = read_hello(&mut stream) else {
            // Not a kiln rank (a port scanner, a stale client): ignore it.
            continue;
        };
        let (rank, world, pid, host) = peer;
        let refuse = if world != spec.world_size {
            Some(format!(
                "rank {rank} on {host} belongs to a job of {world} processes, rank 0's has {}",
                spec.world_size
            ))
        } else if rank == 0 || rank >= world {
            Some(format!("rank {rank} on {host} is out of range 1..{world}"))
        } else if peers[rank - 1].is_some() {
            Some(format!(
                "two processes claim rank {rank} (the second on {host})"
            ))
        } else {
            None
        };
        if let Some(why) = refuse {
            let _ = send_verdict(&mut stream, &why);
            return Err(DistError::BadLaunch {
                what: "the rendezvous".into(),
                why,
            });
        }
        peers[rank - 1] = Some(Peer {
            rank,
            host: format!("{host}, pid {pid}"),
            stream,
        });
    }
    let mut peers: Vec<Peer> = peers.into_iter().flatten().collect();
    for p in &mut peers {
        send_verdict(&mut p.stream, "")
            .map_err(|e| lost(p.rank, &p.host, "the rendezvous", io_why(&e)))?;
    }
    Ok(peers)
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(usize, usize, u32, String)> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a kiln rank");
    if read_u32(s)? != MAGIC || read_u32(s)? != VERSION {
        return Err(bad());
    }
    let rank = read_u32(s)? as usize;
    let world = read_u32(s)? as usize;
    let pid = read_u32(s)?;
    let mut n = [0u8; 2];
    s.read_exact(&mut n)?;
    let mut host = vec![0u8; u16::from_le_bytes(n) as usize];
    s.read_exact(&mut host)?;
    Ok((
        rank,
        world,
        pid,
        String::from_utf8_lossy(&host).into_owned(),
    ))
}

fn send_verdict(s: &mut TcpStream, why: &str) -> std::io::Result<()> {
    let mut b = (why.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(why.as_bytes());
    s.write_all(&b)
}

/// A rank other than 0: connects (retrying while rank 0 is not yet
/// listening), says who it is and waits for the job to be complete.
fn join(spec: &WorldSpec, timeout: Duration) -> Result<Links, DistError> {
    let started = Instant::now();
    let timed_out = || DistError::RendezvousTimeout {
        addr: spec.addr(),
        missing: "rank 0 (or another rank rank 0 waits for)".into(),
        waited: timeout,
        remedy: crate::error::LAUNCHERS_AGREE,
    };
    let mut stream = connect_until(&spec.master_addr, spec.master_port, started + timeout)?
        .ok_or_else(timed_out)?;
    let io = |source| DistError::Io {
        what: format!("joining the job at {}", spec.addr()),
        source,
    };
    stream.write_all(&hello(spec)).map_err(io)?;
    // Rank 0 answers once every rank has joined.
    let left = timeout
        .saturating_sub(started.elapsed())
        .max(Duration::from_secs(1));
    stream.set_read_timeout(Some(left)).map_err(io)?;
    let n = match read_u32(&mut stream) {
        Ok(n) => n,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err(timed_out());
        }
        Err(e) => return Err(io(e)),
    };
    let mut why = vec![0u8; n as usize];
    stream.read_exact(&mut why).map_err(io)?;
    if n > 0 {
        return Err(DistError::BadLaunch {
            what: "the rendezvous".into(),
            why: String::from_utf8_lossy(&why).into_owned(),
        });
    }
    Ok(Links::Leaf {
        root: stream,
        root_host: spec.master_addr.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port")
    }

    fn spec(rank: usize, world: usize, port: u16) -> WorldSpec {
        WorldSpec::local(rank, world, port)
    }

    /// Runs `f` on `world` connected ranks, threads of this process.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(Group) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let g = Group::connect(&spec(r, world, port), Duration::from_secs(20))
                        .expect("joins");
                    f(g)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    #[test]
    fn every_rank_gets_the_same_reduction() {
        let out = on_ranks(3, |g| {
            let r = g.rank() as f32;
            let mut mean = vec![r, 10.0 * r, 0.1];
            g.all_reduce(&mut mean, Reduce::Mean).expect("reduces");
            let mut max = vec![r];
            g.all_reduce(&mut max, Reduce::Max).expect("reduces");
            let mut sum = vec![1.0];
            g.all_reduce(&mut sum, Reduce::Sum).expect("reduces");
            (mean, max, sum)
        });
        for (mean, max, sum) in &out {
            assert_eq!(mean, &out[0].0, "bit-identical on every rank");
            assert_eq!(mean[..2], [1.0, 10.0]);
            assert_eq!(max, &vec![2.0]);
            assert_eq!(sum, &vec![3.0]);
        }
    }

    #[test]
    fn a_bf16_reduction_rounds_each_rank_and_the_result_alike() {
        let out = on_ranks(3, |g| {
            let r = g.rank() as f32;
            // 1 + 2^-10 is not a bf16 (8 bits of mantissa): it rounds to 1.
            let mut mean = vec![r, 1.0 + 2f32.powi(-10) * (r + 1.0), 3.0e-3 * (r + 1.0)];
            g.all_reduce_bf16(&mut mean, Reduce::Mean).expect("reduces");
            let mut f32_mean = vec![1.0 + 2f32.powi(-10)];
            g.all_reduce(&mut f32_mean, Reduce::Mean).expect("reduces");
            (mean, f32_mean)
        });
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        // Each rank's values rounded, summed in f32 on rank 0, the mean rounded.
        let want = vec![
            1.0,
            bf16(
                (bf16(1.0 + 2f32.powi(-10))
                    + bf16(1.0 + 2.0 * 2f32.powi(-10))
                    + bf16(1.0 + 3.0 * 2f32.powi(-10)))
                    / 3.0,
            ),
            bf16((bf16(3.0e-3) + bf16(6.0e-3) + bf16(9.0e-3)) / 3.0),
        ];
        for (mean, f32_mean) in &out {
            assert_eq!(mean, &want, "bit-identical on every rank");
            // The f32 reduction keeps what bf16 drops; the two mix in one job.
            assert_eq!(f32_mean, &vec![1.0 + 2f32.powi(-10)]);
        }
        assert_ne!(out[0].0[2], 6.0e-3, "rounded to bf16");
        assert!((out[0].0[2] - 6.0e-3).abs() < 6.0e-3 / 128.0);
    }

    /// Under torchrun, whose agent's TCPStore holds `MASTER_PORT`: rank 0
    /// listens at a free port and writes it into the store; the others
    /// read it there and join, and the job reduces as any other.
    #[test]
    fn under_torchrun_the_ranks_meet_through_its_store() {
        let store = crate::store::tests::fake_store();
        let world = 3;
        let handles: Vec<_> = (0..world)
            .map(|r| {
                std::thread::spawn(move || {
                    let spec = WorldSpec {
                        torchrun_store_key: Some("kiln/run/attempt_0/rendezvous_port".into()),
                        ..spec(r, world, store)
                    };
                    let g = Group::connect(&spec, Duration::from_secs(20)).expect("joins");
                    let mut v = vec![g.rank() as f32];
                    g.all_reduce(&mut v, Reduce::Sum).expect("reduces");
                    v[0]
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().expect("rank"), 3.0);
        }
        // Rank 0 never writes its port: the others name what they waited for.
        let spec = WorldSpec {
            torchrun_store_key: Some("kiln/run/attempt_1/rendezvous_port".into()),
            ..spec(1, 2, store)
        };
        let e = Group::connect(&spec, Duration::from_millis(300)).expect_err("no rank 0");
        let e = e.to_string();
        assert!(
            e.contains("torchrun's store")
                && e.contains("attempt_1/rendezvous_port")
                && e.contains("set KILN_MASTER_PORT"),
            "{e}"
        );
        // A store that hangs up on kiln's queries (a TCPStore of another
        // protocol drops a client it cannot read): the error names the
        // store and the way around it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                drop(s);
            }
        });
        let hangs_up = WorldSpec {
            torchrun_store_key: Some("kiln/run/attempt_0/rendezvous_port".into()),
            ..super::tests::spec(1, 2, port)
        };
        let e = Group::connect(&hangs_up, Duration::from_secs(5)).expect_err("hung up");
        let e = e.to_string();
        assert!(
            e.contains(&format!("torchrun's store at 127.0.0.1:{port}"))
                && e.contains("set KILN_MASTER_PORT"),
            "{e}"
        );
    }

    /// A job of one rank (`kiln launch --nproc-per-node 1`): rank 0
    /// combines in place with no one, and its values come back as a
    /// reduction of one gives them, rounded where they travel as bf16.
    #[test]
    fn a_world_of_one_gets_its_own_values_back() {
        let odd = 1.0 + 2f32.powi(-10);
        let out = on_ranks(1, move |g| {
            let mut mean = vec![odd, -3.5, 7.0e-3];
            g.all_reduce(&mut mean, Reduce::Mean).expect("reduces");
            let mut max = vec![odd, -1.0];
            g.all_reduce(&mut max, Reduce::Max).expect("reduces");
            let mut bf16 = vec![odd, 3.0e-3];
            g.all_reduce_bf16(&mut bf16, Reduce::Sum).expect("reduces");
            let mut parts = vec![odd, 2.0];
            let mine = g
                .reduce_scatter_bf16(&mut parts, &[2], Reduce::Mean)
                .expect("reduce-scatters");
            (mean, max, bf16, mine)
        });
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        let (mean, max, bf16, mine) = &out[0];
        assert_eq!(mean, &vec![odd, -3.5, 7.0e-3], "f32: bit for bit");
        assert_eq!(max, &vec![odd, -1.0]);
        assert_eq!(bf16, &vec![round(odd), round(3.0e-3)]);
        assert_eq!(bf16[0], 1.0, "rounded to bf16");
        assert_eq!(mine, &vec![1.0, 2.0]);
    }

    #[test]
    fn ranks_that_reduce_in_different_types_are_told_apart() {
        let out = on_ranks(2, |g| {
            let mut v = vec![1.0f32; 4];
            if g.is_root() {
                g.all_reduce_bf16(&mut v, Reduce::Mean)
            } else {
                g.all_reduce(&mut v, Reduce::Mean)
            }
        });
        let err = out[0].as_ref().expect_err("rank 0 sees rank 1's f32 frame");
        assert!(err.to_string().contains("out of step"), "{err}");
    }

    #[test]
    fn slices_of_every_size_gather_in_rank_order_bit_for_bit() {
        // Uneven slices, one empty, with values a text round trip would change.
        let counts = vec![3, 0, 2];
        let out = on_ranks(3, move |g| {
            let r = g.rank();
            let mine: Vec<f32> = (0..counts[r])
                .map(|i| f32::from_bits(0x3f80_0001 + (10 * r + i) as u32))
                .collect();
            let all = g.all_gather_f32(&mine, &counts).expect("gathers");
            let at_root = g.gather_to_root(&[r as u8; 2][..r]).expect("gathers");
            let wrong = g
                .all_gather_f32(&mine, &[1, 1, 1])
                .map_err(|e| e.to_string());
            (all, at_root, wrong)
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = [
            0x3f80_0001u32,
            0x3f80_0002,
            0x3f80_0003,
            0x3f80_0015,
            0x3f80_0016,
        ];
        for (rank, (all, at_root, wrong)) in out.iter().enumerate() {
            assert_eq!(bits(all), want, "rank {rank}");
            if rank == 0 {
                assert_eq!(at_root.as_deref(), Some(&[vec![], vec![1], vec![2, 2]][..]));
            } else {
                assert!(at_root.is_none());
            }
            // A share that is not the rank's count: refused before
            // anything travels, naming the rank.
            let e = wrong.as_ref().expect_err("no rank has 1 value");
            let n = [3, 0, 2][rank];
            assert!(
                e.contains(&format!("rank {rank} gathers {n} values")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_reduce_scatter_gives_each_rank_its_part_of_the_all_reduce() {
        // Uneven parts, one empty; values whose sums round.
        let counts = vec![3, 0, 2];
        let out = on_ranks(3, move |g| {
            let r = g.rank() as f32;
            let values: Vec<f32> = (0..5)
                .map(|i| 0.1 * (i as f32 + 1.0) + r / 3.0 + 1e-7 * r)
                .collect();
            let mut whole = values.clone();
            g.all_reduce(&mut whole, Reduce::Mean).expect("reduces");
            let mine = g
                .reduce_scatter(&mut values.clone(), &counts, Reduce::Mean)
                .expect("reduce-scatters");
            let mut whole_bf16 = values.clone();
            g.all_reduce_bf16(&mut whole_bf16, Reduce::Mean)
                .expect("reduces");
            let mine_bf16 = g
                .reduce_scatter_bf16(&mut values.clone(), &counts, Reduce::Mean)
                .expect("reduce-scatters");
            let wrong = g
                .reduce_scatter(&mut values.clone(), &[2, 2, 2], Reduce::Mean)
                .map_err(|e| e.to_string());
            (whole, mine, whole_bf16, mine_bf16, wrong)
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let starts = [0, 3, 3];
        for (rank, (whole, mine, whole_bf16, mine_bf16, wrong)) in out.iter().enumerate() {
            let n = [3, 0, 2][rank];
            let range = starts[rank]..starts[rank] + n;
            assert_eq!(bits(mine), bits(&whole[range.clone()]), "rank {rank}");
            assert_eq!(bits(mine_bf16), bits(&whole_bf16[range]), "rank {rank}");
            let e = wrong.as_ref().expect_err("6 values are not 5");
            assert!(
                e.contains(&format!("rank {rank} reduce-scatters 5 values")),
                "{e}"
            );
        }
        // The bf16 parts are rounded, the f32 ones are not.
        assert_ne!(bits(&out[0].1), bits(&out[0].3));
    }

    #[test]
    fn an_all_reduce_and_a_reduce_scatter_are_told_apart() {
        let out = on_ranks(2, |g| {
            let mut v = vec![1.0f32; 4];
            if g.is_root() {
                g.reduce_scatter(&mut v, &[2, 2], Reduce::Mean).map(drop)
            } else {
                g.all_reduce(&mut v, Reduce::Mean)
            }
        });
        let err = out[0]
            .as_ref()
            .expect_err("rank 0 sees rank 1's all-reduce");
        assert!(err.to_string().contains("out of step"), "{err}");
    }

    #[test]
    fn checksums_that_differ_are_named() {
        let out = on_ranks(3, |g| {
            let same = g.check_same(7, "weights").map_err(|e| e.to_string());
            let differ = g
                .check_same(if g.rank() == 2 { 8 } else { 7 }, "weights")
                .map_err(|e| e.to_string());
            (same, differ)
        });
        for (same, differ) in out {
            assert!(same.is_ok());
            let e = differ.expect_err("rank 2 differs");
            assert!(e.contains("rank 2 has 0000000000000008"), "{e}");
        }
    }

    #[test]
    fn a_barrier_waits_as_long_as_it_is_told() {
        let out = on_ranks(2, |g| {
            if g.is_root() {
                std::thread::sleep(Duration::from_millis(400));
                let _ = g.barrier(Duration::from_secs(5));
                return (true, true);
            }
            // Rank 0 is busy for 400 ms: a 50 ms barrier gives up, a
            // 5 s one (on a fresh pair of ranks below) does not.
            (g.barrier(Duration::from_millis(50)).is_ok(), false)
        });
        assert_eq!(out[1], (false, false), "the short wait timed out");
        let out = on_ranks(2, |g| {
            if g.is_root() {
                std::thread::sleep(Duration::from_millis(400));
            }
            g.barrier(Duration::from_secs(5)).is_ok()
        });
        assert_eq!(out, [true, true]);
    }

    #[test]
    fn a_rank_that_is_gone_is_named() {
        let out = on_ranks(2, |g| {
            if g.rank() == 1 {
                drop(g);
                return String::new();
            }
            let mut v = vec![1.0];
            g.all_reduce(&mut v, Reduce::Mean)
                .expect_err("rank 1 left")
                .to_string()
        });
        assert!(
            out[0].contains("rank 1") && out[0].contains("connection closed"),
            "{}",
            out[0]
        );
    }

    #[test]
    fn a_rendezvous_that_does_not_complete_names_who_is_missing() {
        let port = free_port();
        let e = Group::connect(&spec(0, 3, port), Duration::from_millis(300))
            .expect_err("nobody joins");
        assert!(e.to_string().contains("rank 1, 2 did not join"), "{e}");
        let e = Group::connect(&spec(1, 2, free_port()), Duration::from_millis(300))
            .expect_err("no rank 0");
        assert!(e.to_string().contains("rank 0"), "{e}");
    }

    #[test]
    fn a_port_in_use_is_refused() {
        let held = TcpListener::bind("0.0.0.0:0").expect("binds");
        let port = held.local_addr().expect("addr").port();
        let e = Group::connect(&spec(0, 2, port), Duration::from_millis(300)).expect_err("in use");
        assert!(
            matches!(e, DistError::PortInUse { .. }) && e.is_bad_input(),
            "{e}"
        );
    }
}
