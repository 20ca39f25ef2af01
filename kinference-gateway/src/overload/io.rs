//! [`StallGuard`]: a client connection whose writes may not stay blocked longer than a deadline.
//!
//! A client that stops reading its answer fills the socket's buffers; the gateway's writes then
//! wait forever, and the stream behind them keeps a worker's slot busy. Past the deadline the
//! guard fails the write, hyper closes the connection and drops the response body, which drops
//! the upstream request: the worker sees its client gone and aborts the generation.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `inner` with a deadline on blocked writes.
#[derive(Debug)]
pub struct StallGuard<T> {
    inner: T,
    deadline: Duration,
    /// Armed while a write is blocked; fires the deadline.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> StallGuard<T> {
    /// Guards `inner`: a write blocked longer than `deadline` fails with `TimedOut`.
    pub fn new(inner: T, deadline: Duration) -> Self {
        StallGuard {
            inner,
            deadline,
            stalled: None,
        }
    }

    /// Passes on a write's outcome: a ready write disarms the timer, a pending one arms it (the
    /// task is woken when it fires) and fails once it has fired.
    fn check<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let deadline = self.deadline;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(Instant::now() + deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {deadline:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.check(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.check(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
