//! The CLI crate's library, one test binary: the serving simulator (`sim`), its Fig. 12
//! sweep (`sweep`), the fp8 accuracy study's qualitative facts (`fp8_accuracy`), and
//! speculative decoding in `pagedkv run` (`spec`).

mod fp8_accuracy;
mod sim;
mod spec;
mod sweep;
