//! The apparatus every benchmark shares: the HTTP client ([`http`]).

pub mod http;
