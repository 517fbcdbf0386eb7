"""The launch plan's rules (cpp/include/attnmerge/plan.h) as the tests state them: the
specification both semantics/test_plan_rules.py (the plan itself, on the CPU) and semantics/test_launch_plan.py (what
GPU calls launch) hold the library to."""

from __future__ import annotations

STATE_CHUNK = 8              # states one thread keeps in flight under "rows" (kStateChunk)
SMALL_CHUNK = 4              # ... where a row has at most this many (kSmallChunk)
BLOCK_THREADS = 256          # the widest N-way rows block (kBlockThreads)
PAIR_BLOCK_THREADS = 256     # the widest two-state block (kPairBlockThreads)
MIN_BLOCK_THREADS = 128      # blocks narrow down to this where the grid would not cover the SMs
STATE_BLOCK = 256            # threads of a states-kernel block, at most one row's (kStateBlockThreads)
STATE_THREADS_PER_SM = 512  # threads of the states kernel an SM holds (kStateThreadsPerSM)
STATES_PER_GROUP = 4         # the fewest states a group takes (kStatesPerGroup)
MAX_STATE_GROUPS = 8         # the most groups a row has (kMaxStateGroups)
ROWS_FILL_FOR_STATES = 4     # states kernel only where rows would fill <= 1/4 of the GPU (kRowsFillForStates)
INDEX32_LIMIT = 1 << 30      # 32-bit offsets below this largest element offset
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def groups_for(states: int, packs: int, rows: int, sms: int) -> int:
    """Groups of threads a row's states are split into (1: the rows kernel): only for more states
    than one thread keeps in flight where the rows kernel would fill at most a quarter of the GPU,
    doubling up to MAX_STATE_GROUPS while each group keeps
    STATES_PER_GROUP states, the row's threads fit one block, and the launch fits the GPU's threads
    at once."""
    if states <= STATE_CHUNK or rows * packs * ROWS_FILL_FOR_STATES > max(sms, 1) * STATE_THREADS_PER_SM:
        return 1
    g = 1
    while 2 * g <= MAX_STATE_GROUPS and 2 * g * STATES_PER_GROUP <= states and packs * 2 * g <= STATE_BLOCK and \
            rows * packs * 2 * g <= max(sms, 1) * STATE_THREADS_PER_SM:
        g *= 2
    return g


def chunk_for(states: int) -> int:
    """States a thread of the N-way rows kernel keeps in flight."""
    return SMALL_CHUNK if states <= SMALL_CHUNK else STATE_CHUNK


def vec_for(head_size: int, *dtypes: str) -> int:
    """Elements per access: 16 bytes of the widest O dtype, if head_size allows it."""
    vec = 16 // max(ELEMENT_BYTES[d] for d in dtypes)
    while head_size % vec:
        vec //= 2
    return vec


def expected_kernel(states: int, packs: int, rows: int, sms: int):
    """(kernel name as attnmerge.last_launch() reports it, groups) of merge_states."""
    groups = groups_for(states, packs, rows, sms)
    return ("rows_plain" if states == 2 else "states" if groups > 1 else "rows"), groups
