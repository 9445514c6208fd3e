//! Socket first: how a connection's loop chooses between its next frame and its other
//! wake-ups (a stop, timers, its writer's end) without paying for those on every frame.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

/// Frames a connection's loop takes from its socket, while frames keep coming, before it
/// polls its other wake-ups ahead of the socket again.
///
/// The other wake-ups each take a lock per poll (a cancellation token's, a `Notify`'s), so
/// [`SocketFirst`] polls them only when the socket has nothing, which is where a connection
/// waits and registers its wakers, and ahead of the socket once every this many frames: a
/// peer that never pauses is still stopped, and its timers still fire, within as many.
pub const FRAMES_BETWEEN_CHECKS: u32 = 64;

/// What [`SocketFirst::next`] woke for.
#[derive(Debug, PartialEq, Eq)]
pub enum Turn<F, W> {
    /// The socket's future finished: a frame, the end of the stream or a read error.
    Frame(F),
    /// One of the loop's other wake-ups finished.
    Other(W),
}

/// One connection loop's choice between its socket and its other wake-ups; see
/// [`FRAMES_BETWEEN_CHECKS`].
#[derive(Debug, Default)]
pub struct SocketFirst {
    /// Frames taken since the other wake-ups were last polled ahead of the socket.
    unchecked: u32,
}

impl SocketFirst {
    /// Waits for `socket` or `others`, whichever finishes first, polling `socket` first
    /// unless [`FRAMES_BETWEEN_CHECKS`] frames went by since `others` last had that place.
    /// `others` is not polled at all when `socket` is ready. Both must be cancel safe: the
    /// one that did not finish is dropped.
    pub async fn next<F, W>(&mut self, socket: F, others: W) -> Turn<F::Output, W::Output>
    where
        F: Future,
        W: Future,
    {
        let others_first = self.unchecked >= FRAMES_BETWEEN_CHECKS;
        if others_first {
            self.unchecked = 0;
        }
        let mut socket = pin!(socket);
        let mut others = pin!(others);
        std::future::poll_fn(|cx| {
            if others_first && let Poll::Ready(woke) = others.as_mut().poll(cx) {
                return Poll::Ready(Turn::Other(woke));
            }
            if let Poll::Ready(frame) = socket.as_mut().poll(cx) {
                self.unchecked += 1;
                return Poll::Ready(Turn::Frame(frame));
            }
            if !others_first && let Poll::Ready(woke) = others.as_mut().poll(cx) {
                return Poll::Ready(Turn::Other(woke));
            }
            Poll::Pending
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A future that counts its polls and is ready once `ready` is set.
    async fn counted(polls: &Cell<u32>, ready: &Cell<bool>) -> &'static str {
        std::future::poll_fn(|_| {
            polls.set(polls.get() + 1);
            if ready.get() { Poll::Ready("other") } else { Poll::Pending }
        })
        .await
    }

    #[tokio::test]
    async fn a_ready_socket_goes_first_and_the_others_are_polled_every_so_many_frames() {
        let mut turns = SocketFirst::default();
        let (polls, ready) = (Cell::new(0), Cell::new(true));
        // The other wake-up is ready all along, yet frames that are here go first...
        for frame in 0..FRAMES_BETWEEN_CHECKS {
            let turn = turns.next(std::future::ready(frame), counted(&polls, &ready)).await;
            assert_eq!(turn, Turn::Frame(frame));
        }
        assert_eq!(polls.get(), 0, "the others were polled although a frame was here");
        // ...until the others' turn comes: then they are polled ahead of the socket.
        let turn = turns.next(std::future::ready(99), counted(&polls, &ready)).await;
        assert_eq!(turn, Turn::Other("other"));
        assert_eq!(polls.get(), 1);
        // A frame taken in that turn (the others not ready) starts the count again.
        ready.set(false);
        let turn = turns.next(std::future::ready(7), counted(&polls, &ready)).await;
        assert_eq!(turn, Turn::Frame(7));
        assert_eq!(polls.get(), 1, "the count started again");
    }

    #[tokio::test]
    async fn the_others_are_polled_when_the_socket_has_nothing() {
        let mut turns = SocketFirst::default();
        let (polls, ready) = (Cell::new(0), Cell::new(true));
        let turn = turns.next(std::future::pending::<u32>(), counted(&polls, &ready)).await;
        assert_eq!(turn, Turn::Other("other"));
        assert_eq!(polls.get(), 1);
    }

    #[tokio::test]
    async fn after_the_others_turn_frames_go_first_again() {
        let mut turns = SocketFirst { unchecked: FRAMES_BETWEEN_CHECKS };
        let (polls, ready) = (Cell::new(0), Cell::new(false));
        assert_eq!(
            turns.next(std::future::ready(1), counted(&polls, &ready)).await,
            Turn::Frame(1)
        );
        assert_eq!(polls.get(), 1, "polled ahead of the socket in its turn");
        ready.set(true);
        assert_eq!(
            turns.next(std::future::ready(2), counted(&polls, &ready)).await,
            Turn::Frame(2)
        );
        assert_eq!(polls.get(), 1, "not polled while a frame is here");
    }
}
