//! x86-64 kernels. Each submodule's functions carry `#[target_feature]`; they are only called
//! through the dispatchers in `codec` and `dot`, which hold a [`crate::level::Verified`] level.
//! Their loads and stores, whose bounds come from array types, also serve the attention
//! kernels of [`crate::attn`] and the loops of [`crate::peak`].

pub(crate) mod avx2;
pub(crate) mod avx512;
