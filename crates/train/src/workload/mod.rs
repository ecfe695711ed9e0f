//! The two workloads, each prepared once from a config for the run, `kiln
//! bench` and `kiln diagnose` alike: the GPT language model ([`lm`]) and
//! the sentence-pair classifier with k-fold cross-validation ([`nli`]).

pub(crate) mod lm;
pub(crate) mod nli;
