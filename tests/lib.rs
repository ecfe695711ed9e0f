//! kiln's end-to-end tests live in `tests.rs` (one integration binary that
//! drives the `kiln` binary) and its modules; this library is empty.
