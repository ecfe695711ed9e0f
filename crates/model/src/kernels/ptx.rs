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
}

/// What a kernel's PTX does, counted in its text: how often each kind of
/// instruction is written (not how often it runs: a loop's body counts
/// once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PtxCounts {
    /// Lines of PTX.
    pub lines: usize,
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
            let op = line.trim_start();
            counts.lines += 1;
            if op.starts_with("bar.sync") || op.starts_with("barrier.sync") {
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

#[cfg(test)]
mod tests {
    use super::PtxCounts;

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
                cube_barriers: 1,
                warp_barriers: 1,
                tensor_core_products: 1,
                local_memory: 2,
                global_loads: 1,
            }
        );
    }
}
