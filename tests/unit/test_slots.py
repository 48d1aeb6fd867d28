"""Unit tests for roles.inference.slots: where a request goes, where its prefix comes from."""

from __future__ import annotations

import pytest

from roles.inference.slots import BLOCK, Placement, SlotTable


def test_requests_take_the_lowest_free_slot_and_freed_slots_come_back() -> None:
    """Live rows stay packed at the front: a freed low slot is taken before higher ones."""
    t = SlotTable(4)
    assert [t.place([10 + i, 1, 2]).slot for i in range(3)] == [0, 1, 2]
    t.release(1, [11, 1])
    assert t.free == 2 and t.highest_live == 2
    assert t.place([99, 98]).slot == 1
    with pytest.raises(RuntimeError, match="not live"):
        t.release(3, [])


def test_a_group_shares_its_prompt_with_the_first_to_arrive() -> None:
    """Identical prompts: the first has no source; each later one copies all of the
    prompt but its last token from the first (live) row's slot."""
    t = SlotTable(8)
    prompt = list(range(40))
    first = t.place(prompt)
    assert first == Placement(0, None, 0)
    assert [t.place(prompt) for _ in range(3)] == [Placement(s, 0, 39) for s in (1, 2, 3)]


def test_a_next_turn_reuses_the_slot_its_previous_turn_left() -> None:
    """A finished row's slot keeps prompt + completion; a prompt that extends it goes
    back into that slot when it is the lowest free, else copies from it (the source is
    reserved until the copies are done)."""
    t = SlotTable(4)
    turn1 = list(range(100, 150))
    a = t.place(turn1)
    completion = [7, 8, 9, 10]
    t.release(a.slot, turn1 + completion[:-1])
    turn2 = turn1 + completion + [200, 201, 202]
    assert t.place(turn2) == Placement(0, 0, len(turn1) + 3)  # back in place, nothing copied
    t.release(0, turn2[:-1])
    t.place([1, 2, 3])  # takes slot 0 (its content goes)
    b = t.place([4, 5])  # slot 1
    t.release(b.slot, [4])
    t2 = t.place(turn2)  # slot 0 is gone: no source for turn2 any more
    assert t2.source is None and t2.slot == 1


def test_a_free_source_is_reserved_until_settled() -> None:
    """A free slot another request copies from is not handed out before ``settle``."""
    t = SlotTable(3)
    p = list(range(50))
    a = t.place([1, 2, 3])  # slot 0
    b = t.place(p)  # slot 1
    t.release(b.slot, p[:-1])
    t.release(a.slot, [1, 2])
    c = t.place(p + [60, 61])  # lowest free is 0; the prefix sits in free slot 1
    assert c == Placement(0, 1, 49)
    assert t.free == 1  # slot 2 only: slot 1 is reserved
    assert t.place([9, 9]).slot == 2
    assert t.free == 0
    t.settle()
    assert t.free == 1 and t.place([8, 8]).slot == 1


def test_partial_prefixes_match_by_blocks_then_by_tokens() -> None:
    """A shared system prompt longer than a block is found and extended token by token;
    a prefix shorter than a block is not indexed (no match), and a match never covers
    the prompt's last token."""
    t = SlotTable(4)
    system = list(range(BLOCK + 5))
    t.place(system + [1000, 1001])
    other = t.place(system + [2000, 2001, 2002])
    assert (other.source, other.shared) == (0, BLOCK + 5)
    short = SlotTable(2)
    short.place([1, 2, 3, 4])
    assert short.place([1, 2, 9, 9]).source is None
    whole = SlotTable(2)
    whole.place([5, 6, 7])
    assert whole.place([5, 6, 7]).shared == 2  # the last token is always fed, not shared
    assert whole.best_source([5]) == (None, 0)


def test_forget_drops_every_free_slots_content() -> None:
    """After a weights swap, kept keys and values are stale: nothing matches them."""
    t = SlotTable(2)
    p = list(range(40))
    a = t.place(p)
    t.release(a.slot, p)
    assert t.best_source(p + [1])[0] == 0
    t.forget()
    assert t.best_source(p + [1]) == (None, 0)
