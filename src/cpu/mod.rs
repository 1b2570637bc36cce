//! The CPU tier's kernels: the reference every other tier is tested against.
//!
//! Each op is a plain function over f32 slices and the checkpoint's own storage formats
//! (bf16/f16/f32 dense rows, MXFP4 expert rows). Dot products always run in the same order for a
//! given row and input, so a batched call gives bit-identical results to one call per token.

pub mod attention;
pub mod layout;
pub mod machine;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod q8;
pub mod q8_activations;
pub mod rope;
pub mod simd;
