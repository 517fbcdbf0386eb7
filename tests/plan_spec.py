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
STATE_THREADS_PER_SM = 1024  # threads of the states kernel an SM holds (kStateThreadsPerSM)
MAX_STATE_GROUPS = 16        # the most groups a row has (kMaxStateGroups)
INDEX32_LIMIT = 1 << 30      # 32-bit offsets below this largest element offset
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def states_rows_limit(states: int, packs: int, sms: int) -> int:
    """The most rows for which merge_states may take the states kernel: one states thread a pack
    fits the GPU at once (sms x STATE_THREADS_PER_SM), or two where a row has at most 2 x STATE_CHUNK
    states."""
    return max(sms, 1) * STATE_THREADS_PER_SM // (packs * (2 if states <= 2 * STATE_CHUNK else 1))


def groups_for(states: int, packs: int, rows: int, sms: int, access_bytes: int = 16) -> int:
    """Groups of threads a row's states are split into (1: the rows kernel): only with 16-byte
    accesses, for more states than one rows thread keeps in flight, up to states_rows_limit rows;
    then the fewest groups from 2 that leave each SMALL_CHUNK states or fewer, while the row's threads
    fit one block and the launch fits the GPU at once (sms x STATE_THREADS_PER_SM), up to
    MAX_STATE_GROUPS; groups of one chunk filling more than half the GPU halved (two chunks each)."""
    capacity = max(sms, 1) * STATE_THREADS_PER_SM
    if access_bytes != 16 or states <= STATE_CHUNK or packs * 2 > STATE_BLOCK or \
            rows > states_rows_limit(states, packs, sms):
        return 1
    g = 2
    while 2 * g <= MAX_STATE_GROUPS and g * SMALL_CHUNK < states and packs * 2 * g <= STATE_BLOCK and \
            rows * packs * 2 * g <= capacity:
        g *= 2
    if g > 2 and g * SMALL_CHUNK >= states and 2 * rows * packs * g > capacity:
        g //= 2
    return g


def pair_block_threads(moved_bytes: int, in_place: bool = False, masked: bool = False) -> int:
    """The widest block of a two-way merge moving `moved_bytes`: wider blocks from 32 MB (512) and
    128 MB (1024); in place 512 at every size, and PAIR_BLOCK_THREADS where masked."""
    if in_place:
        return PAIR_BLOCK_THREADS if masked else 512
    return 1024 if moved_bytes >= 128 << 20 else 512 if moved_bytes >= 32 << 20 else PAIR_BLOCK_THREADS


def chunk_for(states: int) -> int:
    """States a thread of the N-way rows kernel keeps in flight."""
    return SMALL_CHUNK if states <= SMALL_CHUNK else STATE_CHUNK


def vec_for(head_size: int, *dtypes: str) -> int:
    """Elements per access: 16 bytes of the widest O dtype, if head_size allows it."""
    vec = 16 // max(ELEMENT_BYTES[d] for d in dtypes)
    while head_size % vec:
        vec //= 2
    return vec


def expected_kernel(states: int, packs: int, rows: int, sms: int, access_bytes: int = 16):
    """(kernel name as attnmerge.last_launch() reports it, groups) of merge_states."""
    groups = groups_for(states, packs, rows, sms, access_bytes)
    return ("rows_plain" if states == 2 else "states" if groups > 1 else "rows"), groups
