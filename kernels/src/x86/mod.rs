//! x86-64 kernels. Each submodule's functions carry `#[target_feature]`; they are only called
//! through the dispatchers in `codec` and `dot`, which hold a [`crate::level::Verified`] level.

pub(crate) mod avx2;
pub(crate) mod avx512;
