"""A step of N identical layers from the steps of 1, 2 and 3: the timeline of the layers traced once.

A decoder of N identical layers (Llama's 32, a 70B's 80) runs the same operations per layer in
forward, backward and the optimizer step; tracing it under fake tensors costs each operation of
each layer. Traced with 1, 2 and 3 of its layers (`with_layers`), the three steps' logs (the
tracker's `tokens`: every storage counted and freed, each peak check, reset and reading, each
phase, each storage saved for backward and released) are the same sequence with some blocks
repeated once more each time: a layer's forward, its backward, its parameters' optimizer work.
`fold` finds those blocks (where the three logs part and meet again), learns from the second and
third log which copy of a block each reference points to (the layer before, the same layer, the
mirror layer in backward, the first or the last), writes the log of N layers, and replays it for
each phase's peak, the storages alive then and those saved for backward, as the tracker counts
them. Sizes that grow with the layers (a stack of every gradient's norm in clipping) grow by the
same step; the activations and FLOPs of the traced steps are affine in the layers.

Nothing is guessed: the log written for 2 and for 3 layers must be the logs traced, event for event
and peak for peak, or `fold` returns None and the step is traced whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from trainer_memcb.plan.step.timeline import PhasePeak, Timeline

__all__ = ["Recorded", "fold", "layer_list", "with_layers", "FOLDED_LAYERS"]

# The layer counts traced: the step of N layers is folded from these three.
FOLDED_LAYERS = (1, 2, 3)


@dataclasses.dataclass
class Recorded:
    """One traced step: its timeline and the tracker's tokens."""

    timeline: Timeline
    tokens: List[Any]
    labels: Dict[int, Any] = dataclasses.field(default_factory=dict)
    companions: Dict[int, int] = dataclasses.field(default_factory=dict)

    def label(self, serial: int) -> Any:
        """What a storage holds, by name: its own, or that of what it was made from."""
        path = []
        while serial not in self.labels and serial in self.companions and len(path) < 256:
            path.append(serial)
            serial = self.companions[serial]
        found = self.labels.get(serial)
        for made in path:  # each storage on the way named once
            self.labels[made] = found
        return found


def layer_list(model: nn.Module) -> Optional[Tuple[nn.Module, str, nn.ModuleList]]:
    """The model's list of identical layers (its owner, its name in the owner, the list), or None
    where it has none of 4 or more whose classes, parameters and settings are the same."""
    best = None
    for owner in model.modules():
        for name, child in owner.named_children():
            if isinstance(child, nn.ModuleList) and len(child) >= 4:
                size = sum(p.numel() for p in child.parameters())
                if best is None or size > best[0]:
                    best = (size, owner, name, child)
    if best is None:
        return None
    _, owner, name, layers = best
    first = _layer_signature(layers[0])
    if any(_layer_signature(layer) != first for layer in layers):
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_hidden_layers", None) != len(layers):
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return None
    return owner, name, layers


def _layer_signature(layer: nn.Module) -> Tuple[Any, ...]:
    """What makes a layer run its own operations: its modules' classes and plain settings (but its
    index), its parameters' names, shapes, dtypes and whether they train, its buffers'."""
    settings = []
    for path, module in layer.named_modules():
        plain = tuple(sorted((key, value) for key, value in vars(module).items()
                             if not key.startswith("_") and key != "layer_idx"
                             and isinstance(value, (int, float, str, bool, type(None)))))
        settings.append((path, type(module).__qualname__, plain))
    return (tuple(settings),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in layer.named_buffers()))


def with_layers(model: nn.Module, count: int) -> nn.Module:
    """A copy of `model` (on the meta device) with its first `count` layers, its config saying so."""
    import copy

    found = layer_list(model)
    assert found is not None
    owner, name, layers = found
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    setattr(owner, name, nn.ModuleList(list(layers)[:count]))
    before = text.num_hidden_layers, getattr(text, "layer_types", None)
    try:
        text.num_hidden_layers = count
        if before[1] is not None:
            text.layer_types = list(before[1])[:count]
        return copy.deepcopy(model)
    finally:
        setattr(owner, name, layers)
        text.num_hidden_layers = before[0]
        if before[1] is not None:
            text.layer_types = before[1]


# The three logs, token by token --------------------------------------------------------------------

def _signatures(recorded: Recorded) -> List[Tuple[Any, int]]:
    """Each token as the alignment compares it: what it is (not which storage), and the bytes of
    the storage it names (0 for a token that names none)."""
    timeline, out = recorded.timeline, []
    part_of = _parts(timeline)
    sizes = timeline.sizes
    labels = {serial: recorded.label(serial) for serial in sizes}
    for token in recorded.tokens:
        if isinstance(token, int):
            serial = token if token >= 0 else ~token
            out.append((("a" if token >= 0 else "f", part_of[serial], labels[serial]), sizes[serial]))
        elif token[0] == "w":
            out.append((("w", token[1], part_of.get(token[2]), labels.get(token[2])), sizes.get(token[2], 0)))
        elif token[0] == "z":
            out.append((("z",), 0))
        else:
            out.append((token, 0))
    return out


def _parts(timeline: Timeline) -> Dict[int, Tuple[Any, ...]]:
    """serial -> its tag, stream, model state and plan groups."""
    return {serial: (timeline.tags.get(serial), timeline.streams.get(serial), timeline.states.get(serial),
                     tuple(name for name, members in timeline.groups.items() if serial in members))
            for serial in timeline.sizes}


def _blocks(a: Sequence[Any], b: Sequence[Any], c: Sequence[Any]) -> Optional[List[Tuple[int, int, int, int]]]:
    """The blocks `b` holds once and `c` twice more than `a`: (position in a, in b, in c, length).

    Where the three logs part, the block is the shortest run of `b` that `c` holds twice there,
    after which the three agree again for `_AGREE` tokens (or to their ends); where the rest of
    the logs then cannot be split so, the next shortest is tried."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        return _split(a, b, c, 0, 0, 0)
    finally:
        sys.setrecursionlimit(limit)


_AGREE = 1


def _same(x: Tuple[Any, int], y: Tuple[Any, int], z: Tuple[Any, int]) -> bool:
    """Whether tokens of the logs of 1, 2 and 3 layers are one token: the same, or the same but
    for bytes that grow by the same step with each layer (a stack of each gradient's norm)."""
    return x[0] == y[0] == z[0] and z[1] - y[1] == y[1] - x[1]


def _split(a: Sequence[Any], b: Sequence[Any], c: Sequence[Any], i: int, j: int, k: int) -> Optional[List[Tuple[int, int, int, int]]]:
    while i < len(a) and j < len(b) and k < len(c) and _same(a[i], b[j], c[k]):
        i, j, k = i + 1, j + 1, k + 1
    if i == len(a) and j == len(b) and k == len(c):
        return []
    more = (len(b) - j) - (len(a) - i)  # what b holds more than a from here: the blocks' lengths
    if more <= 0 or (len(c) - k) - (len(a) - i) != 2 * more:
        return None
    for length in range(1, more + 1):
        if b[j:j + length] != c[k:k + length] or c[k:k + length] != c[k + length:k + 2 * length]:
            continue
        agree = min(_AGREE, len(a) - i)
        if not all(_same(a[i + n], b[j + length + n], c[k + 2 * length + n]) for n in range(agree)):
            continue
        rest = _split(a, b, c, i, j + length, k + 2 * length)
        if rest is not None:
            return [(i, j, k, length)] + rest
    return None


def _places(length: int, blocks: List[Tuple[int, int, int, int]], copies: int) -> List[Tuple[Any, ...]]:
    """Each position of a log with `copies` copies of each block -> ("common", position in a) or
    ("block", block number, offset, copy)."""
    places: List[Tuple[Any, ...]] = []
    common = 0
    at: Dict[int, List[int]] = {}
    for number, block in enumerate(blocks):
        at.setdefault(block[0], []).append(number)
    while len(places) < length:
        numbers = at.pop(common, None)
        if numbers:
            for number in numbers:
                for copy in range(1, copies + 1):
                    places.extend(("block", number, offset, copy) for offset in range(blocks[number][3]))
            continue
        places.append(("common", common))
        common += 1
    return places


def _serial_places(recorded: Recorded, places: List[Tuple[Any, ...]]) -> Dict[int, Tuple[Any, ...]]:
    """serial -> the place of the token that counted it."""
    return {token: places[index] for index, token in enumerate(recorded.tokens)
            if isinstance(token, int) and token >= 0}


def _referenced(token: Any) -> Tuple[int, ...]:
    """The serials a token names but does not count: a free's, a saved storage's, a resize's."""
    if isinstance(token, int):
        return (~token,) if token < 0 else ()
    if token[0] == "w":
        return (token[2],)
    if token[0] == "z":
        return (token[1], token[2])
    return ()


def _rules(b: Recorded, c: Recorded, b_places, c_places) -> Optional[Dict[Tuple[int, int], Tuple[Any, ...]]]:
    """For each reference of each token of b (its position, the reference's index): which copy of
    which counted storage it names, as a rule over the copies, learned from b's one copy and c's
    two."""
    b_serials, c_serials = _serial_places(b, b_places), _serial_places(c, c_places)
    c_index = {place: index for index, place in enumerate(c_places)}
    rules: Dict[Tuple[int, int], Tuple[Any, ...]] = {}
    for index, token in enumerate(b.tokens):
        names = _referenced(token)
        if not names:
            continue
        place = b_places[index]
        for ref, serial in enumerate(names):
            target = b_serials.get(serial)
            if target is None:
                return None
            if place[0] == "common":
                seen = [(None, 1, target), (None, 2, _target(c, c_index[place], ref, c_serials))]
            else:
                seen = [(1, 1, target)] + [(copy, 2, _target(c, c_index[("block", place[1], place[2], copy)], ref,
                                                               c_serials)) for copy in (1, 2)]
            if any(target is None for _, _, target in seen):
                return None
            rule = _rule(seen)
            if rule is None:
                return None
            rules[(index, ref)] = rule
    return rules


def _target(recorded: Recorded, index: int, ref: int, serials: Dict[int, Tuple[Any, ...]]) -> Optional[Tuple[Any, ...]]:
    names = _referenced(recorded.tokens[index])
    return serials.get(names[ref]) if ref < len(names) else None


# The copy a reference names, as a function of the copy it is made in (k, None in a common
# token) and the number of copies (m): each candidate, tried in this order; a copy outside 1..m
# names the common storage the reference named there instead.
_CANDIDATES = (("same", lambda k, m: k), ("mirror", lambda k, m: m + 1 - k), ("previous", lambda k, m: k - 1),
               ("next", lambda k, m: k + 1), ("mirror previous", lambda k, m: m - k),
               ("mirror next", lambda k, m: m + 2 - k), ("first", lambda k, m: 1), ("last", lambda k, m: m),
               ("before first", lambda k, m: 0), ("after last", lambda k, m: m + 1))
_COMMON_CANDIDATES = _CANDIDATES[6:]


def _rule(seen: List[Tuple[Optional[int], int, Tuple[Any, ...]]]) -> Optional[Tuple[Any, ...]]:
    """The rule that names each target seen, (copy made in, copies, target place), or None."""
    blocks = {target[:3] for _, _, target in seen if target[0] == "block"}
    commons = {target for _, _, target in seen if target[0] == "common"}
    if len(blocks) > 1 or len(commons) > 1:
        return None
    block = next(iter(blocks), None)
    common = next(iter(commons), None)
    if block is None:
        return ("fixed", common)
    candidates = _CANDIDATES if all(copy is not None for copy, _, _ in seen) else _COMMON_CANDIDATES
    for name, copy_of in candidates:
        rule = ("copy", name, block[1], block[2], common)
        if all(_apply(rule, copy, copies) == target for copy, copies, target in seen):
            return rule
    return None


def _apply(rule: Tuple[Any, ...], copy: Optional[int], copies: int) -> Optional[Tuple[Any, ...]]:
    """The place a rule names for a token of copy `copy` (None: a common token) of `copies`."""
    if rule[0] == "fixed":
        return rule[1]
    _, name, number, offset, common = rule
    named = dict(_CANDIDATES)[name](copy, copies)
    if 1 <= named <= copies:
        return ("block", number, offset, named)
    return common


# The log of N layers ----------------------------------------------------------------------------------

class _Unfolded(Exception):
    """The logs do not fold."""


@dataclasses.dataclass
class _Written:
    tokens: List[Any]
    template: Dict[int, int]  # new serial -> the position in b of the token that counted it
    positions: List[int]  # position in b of each token written


def _write(b: Recorded, b_places, blocks, rules, copies: int) -> _Written:
    """b's log with `copies` copies of each block, its serials numbered in the order counted."""
    order: List[Tuple[int, Optional[int]]] = []  # (position in b, copy)
    b_start = {number: block[1] for number, block in enumerate(blocks)}
    index = 0
    while index < len(b.tokens):
        place = b_places[index]
        if place[0] == "block":
            number, size = place[1], blocks[place[1]][3]
            for copy in range(1, copies + 1):
                order.extend((b_start[number] + offset, copy) for offset in range(size))
            index += size
            continue
        order.append((index, None))
        index += 1
    serial_of: Dict[Tuple[Any, ...], int] = {}
    tokens: List[Any] = []
    template: Dict[int, int] = {}
    for position, copy in order:
        token = b.tokens[position]
        place = b_places[position]
        here = place if copy is None else ("block", place[1], place[2], copy)
        if isinstance(token, int) and token >= 0:
            serial = len(template)
            serial_of[here] = serial
            template[serial] = position
            tokens.append(serial)
            continue
        if not _referenced(token):
            tokens.append(token)
            continue
        first = serial_of.get(_apply(rules[(position, 0)], copy, copies))
        if first is None:  # a rule names a storage not counted before it: not this log
            raise _Unfolded(f"token {position} of copy {copy}")
        if isinstance(token, int):
            tokens.append(~first)
        elif token[0] == "w":
            tokens.append(("w", token[1], first))
        else:  # a resize names the serial its storage takes next: counted two tokens on
            tokens.append(("z", first, len(template)))
    return _Written(tokens, template, [position for position, _ in order])


@dataclasses.dataclass
class _Taken:
    name: str
    bytes: int
    phase: str
    storages: Tuple[int, ...]
    saved: frozenset


def _replay(tokens: Sequence[Any], sizes: Dict[int, int]) -> List[_Taken]:
    """Each peak the caller took, as the tracker counted it: the most bytes alive at a check
    since the last reset, the phase then, the storages alive then in the tracker's order (by
    storage, a resized one keeping its place) and those of them saved for backward."""
    alive = 0
    peak = 0
    peak_at = -1
    phase = ""
    phase_at_peak = ""
    taken: List[Tuple[str, int, str, int]] = []
    for index, token in enumerate(tokens):
        if isinstance(token, int):
            alive += sizes[token] if token >= 0 else -sizes[~token]
        elif token[0] == "c":
            if alive > peak:
                peak, peak_at, phase_at_peak = alive, index, phase
        elif token[0] == "r":
            peak = 0
        elif token[0] == "p":
            phase = token[1]
        elif token[0] == "t":
            taken.append((token[1], peak, phase_at_peak, peak_at))
    wanted = {at for _, _, _, at in taken}
    moments: Dict[int, Tuple[Tuple[int, ...], frozenset]] = {}
    place_of: Dict[int, int] = {}  # serial alive -> its storage's place
    order: Dict[int, int] = {}  # place -> the serial alive there, in the order the places were made
    resized: Dict[int, int] = {}  # the new serial of a storage being resized -> its place
    leaving: set = set()  # the old serial of a storage being resized
    saved: set = set()
    for index, token in enumerate(tokens):
        if isinstance(token, int):
            if token >= 0:
                place = resized.pop(token, token)
                place_of[token] = place
                order[place] = token
            else:
                serial = ~token
                place = place_of.pop(serial)
                if serial in leaving:
                    leaving.discard(serial)
                else:
                    del order[place]
        elif token[0] == "w":
            (saved.add if token[1] > 0 else saved.discard)(token[2])
        elif token[0] == "z":
            resized[token[2]] = place_of[token[1]]
            leaving.add(token[1])
            if token[1] in saved:  # the key stays saved; its storage's serial changes
                saved.add(token[2])
        if index in wanted:
            now = tuple(order.values())
            moments[index] = (now, frozenset(serial for serial in now if serial in saved))
    return [_Taken(name, bytes_, phase_, *moments.get(at, ((), frozenset()))) for name, bytes_, phase_, at in taken]


def fold(recorded: Sequence[Recorded], layers: int) -> Optional[Timeline]:
    """The timeline of the step with `layers` identical layers, from the steps traced with
    `FOLDED_LAYERS` of them (`recorded`, in that order), or None where they are not one log with
    blocks repeated (then the step is traced whole)."""
    a, b, c = recorded
    if any(r.timeline.generation is not None or r.timeline.compiled for r in recorded):
        return None
    if _notes(recorded, 1) != b.timeline.notes or _notes(recorded, 2) != c.timeline.notes:
        return None
    sa, sb, sc = (_signatures(r) for r in recorded)
    blocks = _blocks(sa, sb, sc)
    if not blocks:
        return None
    a_places, b_places, c_places = (_places(len(r.tokens), blocks, copies) for copies, r in enumerate(recorded))
    rules = _rules(b, c, b_places, c_places)
    if rules is None:
        return None
    sizes = _sizes(recorded, blocks, (a_places, b_places, c_places))
    if sizes is None:
        return None
    try:
        # The logs written for 2 and 3 layers must be the ones traced, event for event, peak for peak.
        for copies, traced in ((1, b), (2, c)):
            written = _write(b, b_places, blocks, rules, copies)
            if written.tokens != traced.tokens:
                return None
            if _timeline(written, b, sizes, copies, recorded) != traced.timeline:
                return None
        copies = layers - FOLDED_LAYERS[0]
        return _timeline(_write(b, b_places, blocks, rules, copies), b, sizes, copies, recorded)
    except _Unfolded:
        return None


def _notes(recorded: Sequence[Recorded], copies: int) -> Optional[Tuple[str, ...]]:
    """The trace's notes with `copies` copies of each block: the same text, each number in it
    (a kernel's calls, layers counted) affine in the layers (None where one is not)."""
    import re

    notes = [r.timeline.notes for r in recorded]
    if len({len(each) for each in notes}) != 1:
        return None
    out = []
    for texts in zip(*notes):
        parts = [re.split(r"(\d+)", text) for text in texts]
        if len({len(each) for each in parts}) != 1 or any(parts[0][n] != other[n] for other in parts[1:]
                                                          for n in range(0, len(parts[0]), 2)):
            return None
        written = list(parts[1])
        for n in range(1, len(written), 2):
            if parts[0][n] == parts[1][n] == parts[2][n]:
                continue  # as written ("5,056" is two numbers here, "056" one)
            none, one, two = (int(each[n]) for each in parts)
            if two - one != one - none:
                return None
            written[n] = str(one + (copies - 1) * (one - none))
        out.append("".join(written))
    return tuple(out)


def _sizes(recorded: Sequence[Recorded], blocks, places) -> Optional[Dict[int, Tuple[int, int]]]:
    """Position in b of each counting token -> (bytes with one copy, bytes more per copy): the
    same in every copy of a block, affine in the copies for a common storage."""
    a, b, c = recorded
    by_place = []
    for r, p in zip(recorded, places):
        by_place.append({p[index]: r.timeline.sizes[token] for index, token in enumerate(r.tokens)
                         if isinstance(token, int) and token >= 0})
    out: Dict[int, Tuple[int, int]] = {}
    for index, token in enumerate(b.tokens):
        if not (isinstance(token, int) and token >= 0):
            continue
        place = places[1][index]
        one = by_place[1][place]
        if place[0] == "common":
            none, two = by_place[0].get(place), by_place[2].get(place)
            if none is None or two is None or two - one != one - none:
                return None
            out[index] = (one, one - none)
        else:
            key = place[:3]
            if by_place[2].get(key + (1,)) != one or by_place[2].get(key + (2,)) != one:
                return None
            out[index] = (one, 0)
    return out


def _timeline(written: _Written, b: Recorded, sizes, copies: int, recorded: Sequence[Recorded]) -> Timeline:
    """The timeline of `written` (b's log with `copies` copies of each block)."""
    tb = b.timeline
    b_serial = {position: token for position, token in enumerate(b.tokens) if isinstance(token, int) and token >= 0}
    new_sizes = {serial: sizes[position][0] + (copies - 1) * sizes[position][1]
                 for serial, position in written.template.items()}
    old = {serial: b_serial[position] for serial, position in written.template.items()}
    events = tuple(token for token in written.tokens if isinstance(token, int))
    # event index in b -> event index written (the first copy's), for the positions the timeline keeps
    b_event_positions = [position for position, token in enumerate(b.tokens) if isinstance(token, int)]
    first_written: Dict[int, int] = {}
    count = 0
    for token, position in zip(written.tokens, written.positions):
        if isinstance(token, int):
            first_written.setdefault(position, count)
            count += 1

    def moved(event_index: int) -> int:
        if event_index >= len(b_event_positions):
            return len(events)
        return first_written[b_event_positions[event_index]]

    taken = _replay(written.tokens, new_sizes)
    micro = [t for t in taken if t.name == "micro-batch"]
    steps = [t for t in taken if t.name == "optimizer step"]
    numbers = [number for number, _ in tb.micro_batch_peaks] or [1]
    peaks = [(number, PhasePeak(t.phase, t.bytes, t.storages, t.saved)) for number, t in zip(numbers, micro)]
    best_number, best = max(peaks, key=lambda item: item[1].bytes)
    optimizer = None
    if steps:
        t = steps[0]
        optimizer = PhasePeak("optimizer step", t.bytes, t.storages, t.saved)

    def affine(values: Sequence[Optional[int]]) -> Optional[int]:
        if values[1] is None:
            return None
        step = values[1] - values[0]
        return values[1] + (copies - 1) * step

    copies_of: Dict[int, List[int]] = {}  # a serial of b -> its serials written
    for serial, source in old.items():
        copies_of.setdefault(source, []).append(serial)
    groups = {name: frozenset(new for source in members for new in copies_of.get(source, ()))
              for name, members in tb.groups.items()}
    return dataclasses.replace(
        tb, events=events, sizes=new_sizes, notes=_notes(recorded, copies),
        tags={serial: tb.tags[source] for serial, source in old.items() if source in tb.tags},
        groups=groups,
        states={serial: tb.states[source] for serial, source in old.items() if source in tb.states},
        step_start=moved(tb.step_start), forward_backward=best,
        optimizer_step=optimizer if tb.optimizer_step is not None else None,
        activations_bytes=affine([r.timeline.activations_bytes for r in recorded]),
        activations_peak_bytes=affine([r.timeline.activations_peak_bytes for r in recorded]),
        peak_micro_batch=best_number,
        micro_batch_peaks=tuple(peaks) if tb.micro_batch_peaks else (),
        flops=affine([r.timeline.flops for r in recorded]),
        phase_starts={phase: moved(index) for phase, index in tb.phase_starts.items()},
        first_matmul={phase: moved(index) for phase, index in tb.first_matmul.items()},
        streams={serial: tb.streams[source] for serial, source in old.items() if source in tb.streams})
