"""lowmem_dpo: preference tuning (DPO and its relatives) with LoRA on one small GPU, or a CPU. The stages are
its modules (lowmem-dpo train RECIPE.yaml); docs/ is the manual."""

from lowmem_dpo.runtime import heap as _heap

# Before anything imports torch: its CPU allocator reads THP_MEM_ALLOC_ENABLE once (runtime/heap.py).
_heap.huge_pages_before_torch()
