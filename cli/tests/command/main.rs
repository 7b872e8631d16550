//! The `pagedkv` binary as a user runs it, one test binary: its commands and reports
//! (`cli`), and bad input of every kind (`cli_hostile`).

mod cli;
mod cli_hostile;
