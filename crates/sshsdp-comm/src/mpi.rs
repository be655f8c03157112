//! MPI engine (being written).
