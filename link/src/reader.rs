//! Reads frames from a byte stream with the line limit enforced while reading.

use std::io;

use channeld_protocol::framing::{LineEvent, LineFramer};
use channeld_protocol::{DecodeError, Frame, MAX_LINE_BYTES, decode};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Reads frames; memory stays below one maximum line plus one read chunk.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    framer: LineFramer,
    eof: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        Self::with_limit(inner, MAX_LINE_BYTES)
    }

    /// A reader with a custom line limit (newline included).
    pub fn with_limit(inner: R, max_line: usize) -> Self {
        Self { inner, framer: LineFramer::new(max_line), eof: false }
    }

    /// The byte stream it reads from.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The next frame, a decode error for a bad line, or `Ok(None)` when the peer closed.
    ///
    /// A bad line never ends the stream: the caller answers it and keeps reading. This method
    /// is cancel-safe: dropping its future loses no bytes.
    pub async fn next(&mut self) -> io::Result<Option<Result<Frame, DecodeError>>> {
        loop {
            match self.framer.next_line() {
                Some(LineEvent::Line(line)) => {
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    return Ok(Some(decode(line)));
                }
                Some(LineEvent::TooLong) => return Ok(Some(Err(DecodeError::LineTooLong))),
                None => {}
            }
            if self.eof {
                return Ok(match self.framer.take_remainder() {
                    Some(rest) if !rest.iter().all(u8::is_ascii_whitespace) => Some(decode(&rest)),
                    _ => None,
                });
            }
            let read = self.inner.read_buf(self.framer.buffer_for_read()).await?;
            if read == 0 {
                self.eof = true;
            }
        }
    }

    /// Whether [`next`](Self::next) will return without reading: a frame (or a line too
    /// long) is buffered whole. Blank lines, which it skips, do not count.
    pub fn ready(&self) -> bool {
        self.framer.peek_line().is_some_and(|line| !line.iter().all(u8::is_ascii_whitespace))
    }

    /// Bytes currently held for an incomplete line.
    pub fn buffered(&self) -> usize {
        self.framer.buffered()
    }

    /// Current size of the read buffer's allocation.
    pub fn buffer_capacity(&self) -> usize {
        self.framer.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn oversize_line_is_skipped_and_the_next_frame_read() {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let mut reader = FrameReader::with_limit(server, 1024);
        let writer = tokio::spawn(async move {
            let mut client = client;
            client.write_all(&vec![b'x'; 10_000]).await.unwrap();
            client
                .write_all(b"\n{\"abi\":\"cortexfs.channel.socket/v1\",\"frame\":{\"type\":\"start\",\"request_id\":\"a\"}}\n")
                .await
                .unwrap();
        });
        assert_eq!(reader.next().await.unwrap(), Some(Err(DecodeError::LineTooLong)));
        assert!(matches!(reader.next().await.unwrap(), Some(Ok(Frame::Start(_)))));
        writer.await.unwrap();
        assert_eq!(reader.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn ready_only_when_a_frame_is_buffered_whole() {
        let start = b"{\"abi\":\"cortexfs.channel.socket/v1\",\"frame\":{\"type\":\"start\",\"request_id\":\"a\"}}\n";
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let mut reader = FrameReader::new(server);
        assert!(!reader.ready());
        client.write_all(start).await.unwrap();
        client.write_all(start).await.unwrap();
        client.write_all(b"\n{\"abi\"").await.unwrap();
        assert!(matches!(reader.next().await.unwrap(), Some(Ok(Frame::Start(_)))));
        assert!(reader.ready(), "the second frame came in the same read");
        assert!(matches!(reader.next().await.unwrap(), Some(Ok(Frame::Start(_)))));
        // A blank line and half a frame: `next` would read.
        assert!(!reader.ready());
    }
}
