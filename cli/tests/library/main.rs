//! The CLI crate's library, one test binary: the serving simulator (`sim`), its Fig. 12
//! sweep (`sweep`), the fp8 accuracy study's qualitative facts (`fp8_accuracy`),
//! speculative decoding in `pagedkv run` (`spec`), and the memory a simulation holds
//! (`memory`, with this binary's counting allocator).

mod fp8_accuracy;
mod memory;
mod sim;
mod spec;
mod sweep;
