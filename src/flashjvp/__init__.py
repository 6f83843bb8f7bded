"""flashjvp: FlashAttention with a fused forward-mode derivative (JVP), in Triton."""

from flashjvp import block_masks
from flashjvp.block_masks import prepare_block_mask
from flashjvp.interface import attention, attention_jvp, attention_varlen, attention_varlen_jvp
from flashjvp.ref import attention_jvp_ref, attention_ref, attention_varlen_jvp_ref, attention_varlen_ref
from flashjvp.sdpa import patch_sdpa, sdpa

__all__ = ["attention", "attention_jvp", "attention_varlen", "attention_varlen_jvp", "attention_ref",
           "attention_jvp_ref", "attention_varlen_ref", "attention_varlen_jvp_ref", "sdpa", "patch_sdpa",
           "block_masks", "prepare_block_mask"]
__version__ = "0.1.0"
