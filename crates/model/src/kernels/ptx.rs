//! What a kernel compiled without a device looks like: the result of
//! `kiln check-kernels --cuda-arch` (the compiling is
//! `kernels/cube/offline.rs`, in CUDA builds) and the counts of its PTX.
//! Plain text processing: in every build.

/// One kernel compiled for a CUDA architecture by one of CubeCL's
/// compilers.
#[derive(Debug)]
pub struct OfflineKernel {
    /// Which kernel, with the shape it was compiled for.
    pub name: String,
    /// `"llvm"` (PTX, what kiln runs by default) or `"cpp"` (CUDA C++
    /// source for NVRTC, the `cuda-cpp` build's).
    pub compiler: &'static str,
    /// The PTX or the C++ source, or why it did not compile.
    pub assembly: Result<String, String>,
    /// Units (threads) a cube (block) of the launch.
    pub units: u32,
    /// Shared memory a cube, in bytes (dynamic: what the launch reserves;
    /// 0 where it did not compile).
    pub shared_bytes: usize,
}

/// What a kernel's PTX does, counted in its text: how often each kind of
/// instruction is written (not how often it runs: a loop's body counts
/// once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PtxCounts {
    /// Lines of PTX.
    pub lines: usize,
    /// Instructions: lines ending in `;` that are not directives
    /// (`.reg`, `.shared`, ...), labels or comments.
    pub instructions: usize,
    /// Exponentials by the special-function unit (`ex2.approx`): one per
    /// `exp` in the kernel, fast (`KILN_FAST_EXP=1`: the instruction and a
    /// product before it) or accurate (libdevice's `__nv_expf`: a range
    /// reduction of about eight instructions around it).
    pub exponentials: usize,
    /// Barriers of the whole cube (`bar.sync`, `barrier.sync`).
    pub cube_barriers: usize,
    /// Barriers of one warp (`bar.warp.sync`).
    pub warp_barriers: usize,
    /// Tensor-core products (`wmma.mma`, `mma.sync`).
    pub tensor_core_products: usize,
    /// Loads and stores of local memory (`ld.local`, `st.local`): arrays
    /// the compiler could not keep in registers.
    pub local_memory: usize,
    /// Loads from global memory (`ld.global`).
    pub global_loads: usize,
}

impl PtxCounts {
    /// Counts `ptx`'s instructions.
    pub fn of(ptx: &str) -> Self {
        let mut counts = PtxCounts::default();
        for line in ptx.lines() {
            let op = line.trim();
            counts.lines += 1;
            if op.ends_with(';') && !op.starts_with('.') && !op.starts_with("//") {
                counts.instructions += 1;
            }
            if op.starts_with("ex2.approx") {
                counts.exponentials += 1;
            } else if op.starts_with("bar.sync") || op.starts_with("barrier.sync") {
                counts.cube_barriers += 1;
            } else if op.starts_with("bar.warp.sync") {
                counts.warp_barriers += 1;
            } else if op.starts_with("wmma.mma") || op.starts_with("mma.sync") {
                counts.tensor_core_products += 1;
            } else if op.starts_with("ld.local") || op.starts_with("st.local") {
                counts.local_memory += 1;
            } else if op.starts_with("ld.global") {
                counts.global_loads += 1;
            }
        }
        counts
    }
}

/// The PTX's target (`sm_90a`), what `ptxas -arch` must be given.
pub fn ptx_target(ptx: &str) -> Option<&str> {
    ptx.lines()
        .find_map(|line| line.trim_start().strip_prefix(".target"))
        .and_then(|rest| rest.split([',', ' ', '\t']).find(|s| !s.is_empty()))
}

/// What NVIDIA's assembler (`ptxas -v`) says of a kernel: the registers a
/// unit and what did not fit in them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Registers {
    /// Registers a unit (thread).
    pub registers: u32,
    /// Bytes a unit written to local memory because registers ran out.
    pub spill_stores: u64,
    /// Bytes a unit read back from them.
    pub spill_loads: u64,
    /// The unit's stack frame in local memory, in bytes.
    pub stack_frame: u64,
}

impl Registers {
    /// Reads `ptxas -v`'s report of one kernel (its standard error):
    /// `Used 105 registers`, `0 bytes stack frame, 0 bytes spill stores, 0
    /// bytes spill loads`. `None` when it has no register count.
    pub fn parse(report: &str) -> Option<Self> {
        /// The number right before `what` in `text`.
        fn before(text: &str, what: &str) -> Option<u64> {
            let end = text.find(what)?;
            text[..end].split_whitespace().last()?.parse().ok()
        }
        let mut out = Registers::default();
        let mut found = false;
        for line in report.lines() {
            if let Some(n) = before(line, " registers") {
                out.registers = n.try_into().ok()?;
                found = true;
            }
            if let Some(n) = before(line, " bytes stack frame") {
                out.stack_frame = n;
            }
            if let Some(n) = before(line, " bytes spill stores") {
                out.spill_stores = n;
            }
            if let Some(n) = before(line, " bytes spill loads") {
                out.spill_loads = n;
            }
        }
        found.then_some(out)
    }

    /// Whether anything was spilled to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// How many cubes of a kernel one streaming multiprocessor holds at once,
/// and what stops it holding more: CUDA's occupancy calculation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Occupancy {
    /// Cubes (blocks) resident on one multiprocessor; 0: it cannot launch.
    pub cubes: u32,
    /// Warps resident, of `max_warps`.
    pub warps: u32,
    /// The most warps a multiprocessor holds.
    pub max_warps: u32,
    /// What bounds `cubes`: `"registers"`, `"shared memory"`, `"units"`
    /// (the multiprocessor's threads) or `"cubes"` (its block slots).
    pub limited_by: &'static str,
}

/// One multiprocessor of a compute capability, as CUDA's programming
/// guide tabulates it ("Technical Specifications per Compute
/// Capability").
struct Multiprocessor {
    max_warps: u32,
    max_cubes: u32,
    /// Shared memory of the multiprocessor, and the most one cube may
    /// have, in KiB.
    shared_kib: usize,
    shared_per_cube_kib: usize,
    /// Shared memory the runtime keeps for itself a cube (8.0 on).
    reserved: usize,
}

/// The multiprocessor of compute capability `arch` (90: H100/H200), where
/// kiln knows it.
fn multiprocessor(arch: u32) -> Option<Multiprocessor> {
    let (max_warps, max_cubes, shared_kib, shared_per_cube_kib) = match arch {
        70 | 72 => (64, 32, 96, 96),
        75 => (32, 16, 64, 64),
        80 => (64, 32, 164, 163),
        86 => (48, 16, 100, 99),
        87 => (48, 16, 164, 163),
        89 => (48, 24, 100, 99),
        90 | 100 | 103 => (64, 32, 228, 227),
        _ => return None,
    };
    Some(Multiprocessor {
        max_warps,
        max_cubes,
        shared_kib,
        shared_per_cube_kib,
        reserved: if arch >= 80 { 1024 } else { 0 },
    })
}

/// The most shared memory one cube may have on compute capability `arch`,
/// in bytes, where kiln knows it (the offline compile's assumed device).
#[cfg(feature = "cuda")]
pub(crate) fn max_shared_per_cube(arch: u32) -> Option<usize> {
    multiprocessor(arch).map(|m| m.shared_per_cube_kib * 1024)
}

/// Cubes of `units` units with `registers` registers a unit and
/// `shared_bytes` of shared memory resident on one multiprocessor of
/// compute capability `arch`; `None` where kiln does not know the
/// architecture. Registers are given out 256 a warp and warps 4 at a time
/// (the four schedulers), shared memory 128 bytes at a time, as CUDA's
/// occupancy calculator does.
pub fn occupancy(arch: u32, units: u32, registers: u32, shared_bytes: usize) -> Option<Occupancy> {
    const REGISTER_FILE: u32 = 64 * 1024;
    let sm = multiprocessor(arch)?;
    let warps = units.div_ceil(32).max(1);
    let per_warp = (registers.max(1) * 32).div_ceil(256) * 256;
    let warps_by_registers = (REGISTER_FILE / per_warp) / 4 * 4;
    let shared = (shared_bytes + sm.reserved).div_ceil(128) * 128;
    let by_shared = if shared_bytes > sm.shared_per_cube_kib * 1024 {
        0
    } else {
        (sm.shared_kib * 1024 / shared) as u32
    };
    let limits = [
        (sm.max_cubes, "cubes"),
        (sm.max_warps / warps, "units"),
        (
            if registers > 255 {
                0
            } else {
                warps_by_registers / warps
            },
            "registers",
        ),
        (by_shared, "shared memory"),
    ];
    let (cubes, limited_by) = limits
        .into_iter()
        .min_by_key(|(n, _)| *n)
        .unwrap_or((0, "cubes"));
    Some(Occupancy {
        cubes,
        warps: cubes * warps,
        max_warps: sm.max_warps,
        limited_by,
    })
}

#[cfg(test)]
mod tests {
    use super::{Occupancy, PtxCounts, Registers, occupancy, ptx_target};

    #[test]
    fn ptxas_reports_are_read() {
        // What ptxas 12.9 printed for kiln's kernels.
        let report = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'dkdv_kernel' for 'sm_90a'\n\
            ptxas info    : Function properties for dkdv_kernel\n    \
            392 bytes stack frame, 388 bytes spill stores, 392 bytes spill loads\n\
            ptxas info    : Used 255 registers, used 0 barriers, 392 bytes cumulative stack size\n";
        let r = Registers::parse(report).expect("a register count");
        assert_eq!(
            r,
            Registers {
                registers: 255,
                spill_stores: 388,
                spill_loads: 392,
                stack_frame: 392,
            }
        );
        assert!(r.spills());
        let clean = Registers::parse("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 105 registers, used 1 barriers")
            .expect("a register count");
        assert_eq!(clean.registers, 105);
        assert!(!clean.spills());
        assert_eq!(
            Registers::parse("ptxas fatal   : Unresolved extern function"),
            None
        );
    }

    #[test]
    fn ptx_instructions_and_exponentials_are_counted() {
        // LLVM's PTX for one accurate exponential (libdevice's `__nv_expf`)
        // and one fast (`__nv_fast_expf`), with a kernel's directives,
        // labels and braces around them.
        let ptx = "//\n.version 8.0\n.target sm_90a\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n\
            \t.reg .b32 \t%r<16>;\n\
            \tld.param.b64 \t%rd1, [k_param_0];\n\
            \tfma.rn.f32 \t%r2, %r1, 0f3BBB989D, 0f3F000000;\n\
            \tcvt.sat.f32.f32 \t%r3, %r2;\n\
            \tfma.rm.f32 \t%r4, %r3, %r5, %r6;\n\
            \tadd.rn.f32 \t%r7, %r4, 0fCB40007F;\n\
            \tfma.rn.f32 \t%r8, %r1, 0f3FB8AA3B, %r7;\n\
            \tshl.b32 \t%r9, %r4, 23;\n\
            \tex2.approx.ftz.f32 \t%r10, %r8;\n\
            \tmul.rn.f32 \t%r11, %r10, %r9;\n\
            $L__BB0_1:\n\
            \tmul.rn.f32 \t%r12, %r11, 0f3FB8AA3B;\n\
            \tex2.approx.ftz.f32 \t%r13, %r12;\n\
            \tbar.sync \t0;\n\
            \tret;\n}\n";
        let c = PtxCounts::of(ptx);
        assert_eq!(c.exponentials, 2);
        assert_eq!(c.instructions, 13);
        assert_eq!(c.cube_barriers, 1);
        assert_eq!(c.lines, ptx.lines().count());
    }

    #[test]
    fn ptx_target_is_read() {
        assert_eq!(
            ptx_target("//\n.version 8.0\n.target sm_90a\n"),
            Some("sm_90a")
        );
        assert_eq!(ptx_target(".target sm_80, debug\n"), Some("sm_80"));
        assert_eq!(ptx_target(".version 8.0\n"), None);
    }

    #[test]
    fn occupancy_follows_cuda_s_calculator() {
        // FlashAttention-2's forward on an H100: 4 warps, 105 registers
        // (112 allocated: 18 warps' worth, 16 in fours), 31 KiB shared.
        assert_eq!(
            occupancy(90, 128, 105, 31 * 1024),
            Some(Occupancy {
                cubes: 4,
                warps: 16,
                max_warps: 64,
                limited_by: "registers",
            })
        );
        // Few registers, much shared memory: 228 KiB / (100 + 1) KiB.
        let o = occupancy(90, 128, 32, 100 * 1024).expect("a known architecture");
        assert_eq!((o.cubes, o.limited_by), (2, "shared memory"));
        // Few of everything: the block slots.
        let o = occupancy(90, 32, 16, 0).expect("a known architecture");
        assert_eq!((o.cubes, o.limited_by), (32, "cubes"));
        // Large cubes: the multiprocessor's threads (48 warps on an 8.9).
        let o = occupancy(89, 1024, 32, 0).expect("a known architecture");
        assert_eq!((o.cubes, o.limited_by), (1, "units"));
        // More shared memory than a cube may have: it does not launch.
        assert_eq!(
            occupancy(80, 128, 32, 200 * 1024)
                .expect("a known architecture")
                .cubes,
            0
        );
        assert_eq!(occupancy(61, 128, 32, 0), None);
    }

    #[test]
    fn ptx_counts_tell_barriers_products_and_memory_apart() {
        let ptx = "\tbar.sync \t0;\n\
                   \tbar.warp.sync \t-1;\n\
                   \twmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32 {%r1}, {%r2}, {%r3}, {%r4};\n\
                   \tld.local.b32 \t%r5, [%rd1];\n\
                   \tst.local.b32 \t[%rd1], %r5;\n\
                   \tld.global.nc.v4.b32 \t{%r6, %r7, %r8, %r9}, [%rd2];\n\
                   \tld.shared.b32 \t%r10, [%rd3];\n\
                   \twmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 \t{%r11}, [%rd4], %r12;";
        assert_eq!(
            PtxCounts::of(ptx),
            PtxCounts {
                lines: 8,
                instructions: 8,
                exponentials: 0,
                cube_barriers: 1,
                warp_barriers: 1,
                tensor_core_products: 1,
                local_memory: 2,
                global_loads: 1,
            }
        );
    }
}
