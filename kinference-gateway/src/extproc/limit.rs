//! The ext_proc port's connection limit: accepted connections hold a permit until they close; past
//! the limit a new connection is closed at once (counted and logged at most every 10 s), so a proxy
//! that opens connections without end cannot take the gateway's file descriptors and memory.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Accepted connections, at most `limit` open at once.
pub struct Limited<S> {
    inner: S,
    permits: Arc<Semaphore>,
    refused: Arc<AtomicU64>,
    last_log: Mutex<Option<Instant>>,
}

impl<S> Limited<S> {
    /// At most `limit` of `inner`'s connections open at once.
    pub fn new(inner: S, limit: usize) -> Self {
        Limited {
            inner,
            permits: Arc::new(Semaphore::new(limit)),
            refused: Arc::default(),
            last_log: Mutex::new(None),
        }
    }

    fn refuse(&self) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last_log.lock();
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            *last = Some(Instant::now());
            tracing::warn!(
                refused,
                "ext_proc connection refused: the port is at --extproc-max-connections"
            );
        }
    }
}

impl<S> Stream for Limited<S>
where
    S: Stream<Item = std::io::Result<TcpStream>> + Unpin,
{
    type Item = std::io::Result<Held>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(stream))) => {
                    match Arc::clone(&this.permits).try_acquire_owned() {
                        Ok(permit) => {
                            return Poll::Ready(Some(Ok(Held {
                                stream,
                                _permit: permit,
                            })));
                        }
                        // Dropping the stream closes it.
                        Err(_) => this.refuse(),
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    // EMFILE and the like: not the server's end.
                    tracing::warn!(%error, "ext_proc accept failed");
                    continue;
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// An accepted connection with its place under the limit.
pub struct Held {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl Connected for Held {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Held {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;
    use tokio::net::TcpListener;
    use tokio_stream::wrappers::TcpListenerStream;

    #[tokio::test]
    async fn past_the_limit_a_connection_is_closed_and_a_place_comes_back_with_a_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut limited = Limited::new(TcpListenerStream::new(listener), 2);
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let first = limited.next().await.unwrap().unwrap();
        let _second = limited.next().await.unwrap().unwrap();
        // The third is refused: nothing more comes out while both places are held.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), limited.next())
                .await
                .is_err()
        );
        // A place given back: the next connection is accepted.
        drop(first);
        clients.push(TcpStream::connect(addr).await.unwrap());
        let _fourth = limited.next().await.unwrap().unwrap();
        assert_eq!(limited.refused.load(Ordering::Relaxed), 1);
        // The refused connection was closed: its client reads the end.
        use tokio::io::AsyncReadExt as _;
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), clients[2].read(&mut buf))
            .await
            .expect("closed, not left open")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
}
