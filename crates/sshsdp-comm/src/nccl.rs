//! NCCL engine (being written).
