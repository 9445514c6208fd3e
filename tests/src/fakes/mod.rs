pub mod slack;
