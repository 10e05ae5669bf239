"""ZeRO-3's fetch, prefetch and release decisions over a step's module trace, as DeepSpeed 0.19.8's
`PartitionedParameterCoordinator` (runtime/zero/partitioned_param_coordinator.py) takes them once
its trace is complete (from the second step on).

No memory here: which parameters are whole after each fetch and release, so that the step plan
makes and frees their buffers at those moments. The trace is a list of steps, one per module use
(its forward, then its backward), each the module's own parameters in their `ds_id` order.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Hashable, List, Sequence, Set, Tuple

__all__ = ["FetchCoordinator"]

_NEVER = -int(1e10)  # `__most_recent_step_id_param_fetched_for`'s default


class FetchCoordinator:
    """The coordinator's state over one step's trace.

    Args:
        trace: per module use, (the module's key, its own parameters' keys in `ds_id` order).
        numel: each parameter's values (`ds_numel`).
        persistent: the parameters kept whole (`ds_persist`): never gathered, never released.
        prefetch_bucket_size, max_live_parameters, max_reuse_distance: the `stage3_` settings.
    """

    def __init__(self, trace: Sequence[Tuple[Hashable, Sequence[Hashable]]], numel: Dict[Hashable, int],
                 persistent: Set[Hashable], prefetch_bucket_size: int, max_live_parameters: int,
                 max_reuse_distance: int) -> None:
        self.trace = list(trace)
        self.numel = numel
        self.persistent = set(persistent)
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live_parameters = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        # reset_step: the queue is the whole trace's parameters, in order.
        self.queue = collections.deque((param, step) for step, (_, params) in enumerate(self.trace) for param in params)
        self.most_recent: Dict[Hashable, int] = collections.defaultdict(lambda: _NEVER)
        self.available: Set[Hashable] = set(self.persistent)
        self.n_available = 0
        self.step = 0
        self.active: Dict[Hashable, Set[Hashable]] = collections.defaultdict(set)

    def expects(self, module: Hashable) -> bool:
        """Whether `module` is the trace's next use (`trace_prologue`: else DeepSpeed drops the trace)."""
        return self.step < len(self.trace) and self.trace[self.step][0] == module

    def _gather(self, params: Any) -> List[Hashable]:
        # __all_gather_params_: only the parameters not yet whole count toward `__n_available_params`.
        gathered = [param for param in params if param not in self.available]
        self.available.update(gathered)
        self.n_available += sum(self.numel[param] for param in gathered)
        return gathered

    def fetch(self) -> List[Hashable]:
        """fetch_sub_module for the trace's next use: the parameters that become whole (its own, then
        the prefetched ones)."""
        module, params = self.trace[self.step]
        gathered = self._gather(params)
        # Pop the module's own parameters off the queue, unless a prefetch already did.
        not_fetched = {param for param in params if self.most_recent[param] < self.step}
        popped: Set[Hashable] = set()
        while self.queue and len(popped) < len(not_fetched):
            param, step = self.queue.popleft()
            self.most_recent[param] = step
            popped.add(param)
        for param in params:
            self.active[param].add(module)
        if self.prefetch_bucket_size > 0:
            # The next uses' parameters, until at least min(the room under max_live_parameters, the
            # bucket) values are on their way; a whole one is passed over, its use marked fetched.
            limit = min(self.max_live_parameters - self.n_available, self.prefetch_bucket_size)
            chosen: List[Hashable] = []
            values = 0
            while self.queue and values < limit:
                param, step = self.queue.popleft()
                if param not in self.available and param not in chosen:
                    chosen.append(param)
                    values += self.numel[param]
                self.most_recent[param] = max(self.most_recent[param], step)
            gathered += self._gather(chosen)
        self.step += 1
        return gathered

    def release(self, index: int) -> List[Hashable]:
        """release_sub_module for the use at `index` (its post-hook, `self.step` uses fetched so far):
        the parameters that go back to their partitions (__params_to_release, __release_param)."""
        module, params = self.trace[index]
        to_release = {param for param in params if param not in self.persistent}
        # A use a prefetch passed over (the parameter whole then) is not fetched again: keep it.
        to_release -= {param for param in params if self.most_recent[param] > self.step}
        # Kept when the next uses within `stage3_max_reuse_distance` values need it again.
        traversed = 0
        for _, later in self.trace[self.step:]:
            if traversed >= self.max_reuse_distance:
                break
            for param in later:
                to_release.discard(param)
                traversed += self.numel[param]
        released = []
        for param in params:
            self.active[param].discard(module)
            if param in to_release and param in self.available and not self.active[param]:
                self.available.discard(param)
                self.n_available -= self.numel[param]
                released.append(param)
        return released
