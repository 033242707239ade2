"""The tool-use reward on real ToolAlpaca rows (action multiset + merged Action Input JSON).

Responses are hand-written for real rows of ../shared/data/tooluse/test.jsonl; expectations follow the
paper's rule as stated in the data README, worked out by hand (including its quirks: last key wins when
merging, non-greedy ``{...}`` blocks, unparsable blocks skipped).
"""

from __future__ import annotations

import functools

import pytest

from srpo_megatron.data import default_data_dir, load_rows
from srpo_megatron.rewards import get_reward_fn


@functools.cache
def gold(line: int) -> str:
    rows, _ = load_rows(default_data_dir() / "tooluse/test.jsonl")
    row = next(r for r in rows if r.source.endswith(f":{line}"))
    assert row.kind == "tooluse" and row.system is None
    return row.answer


# line 1: getRandomAxolotlImage {}
# line 2: searchAxolotlImages {"color": "wild", "gender": "", "size": "medium", "page": 1}
# line 3: getAxolotlFacts {"category": "habitat", "limit": 3}
# line 7: searchAxolotlImages x3, size small / medium / large (merged: size "large")
# line 10: searchAxolotlImages x2, gender male / female (merged: gender "female")
# line 18: checkIPReputation {"ip"} + reportAbusiveIP {"ip", "categories": [...], "comment"}
# line 34: getUserProfile + "[Optional]updateUserProfile" with a nested object (unmatchable by \w+)
S2 = '{"color": "wild", "gender": "", "size": "medium", "page": 1}'
IP = '{"ip": "168.0.99.1"}'
REPORT = (
    '{"ip": "168.0.99.1", "categories": ["malware", "hacking"], "comment": "Suspected malicious activities."}'
)
REPORT_SWAPPED = REPORT.replace('["malware", "hacking"]', '["hacking", "malware"]')
RANDOM, SEARCH, FACTS = "getRandomAxolotlImage", "searchAxolotlImages", "getAxolotlFacts"


def call(action: str, action_input: str | None = None) -> str:
    text = f"Action: {action}\n"
    return text if action_input is None else text + f"Action Input: {action_input}\n"


def search(size: str, color: str = "wild", gender: str = "") -> str:
    return f'{{"color": "{color}", "gender": "{gender}", "size": "{size}", "page": 1}}'


def searches(*sizes: str) -> str:
    return "".join(call(SEARCH, search(s)) for s in sizes)


FEMALE = search("medium", gender="female")
HABITAT = '{"category": "habitat", "limit": 3}'

CASES = [
    # line 1: no parameters
    (1, "Thought: get a picture.\n" + call(RANDOM, "{}"), 1.0),
    (1, call(RANDOM, "{}") + "Observation: ...", 1.0),
    (1, f"Action:{RANDOM}\nAction Input:{{}}", 1.0),  # \s* allows no space
    (1, call(RANDOM), 1.0),  # no input block merges to {} == reference {}
    (1, call(RANDOM, '{"n": 1}'), 0.0),  # extra key
    (1, call(FACTS, "{}"), 0.0),  # wrong tool
    (1, call(RANDOM, "{}") * 2, 0.0),  # the multiset has one call too many
    (1, f"I would call {RANDOM}.", 0.0),  # no Action: line
    # line 2: one call with parameters
    (2, "Thought: search.\n" + call(SEARCH, S2), 1.0),
    (2, call(SEARCH, '{"page": 1, "size": "medium", "gender": "", "color": "wild"}'), 1.0),  # key order
    (2, call(SEARCH, '{\n  "color": "wild",\n  "gender": "",\n  "size": "medium",\n  "page": 1\n}'), 1.0),
    (2, call(SEARCH, '{"color": "wild", "size": "medium", "page": 1}'), 0.0),  # a key missing
    (2, call(SEARCH, S2.replace('"page": 1', '"page": "1"')), 0.0),  # "1" != 1
    (2, call(SEARCH, S2.replace('"', "'")), 0.0),  # single quotes are not JSON: skipped, {} != reference
    # JSON split across two blocks merges to the reference
    (2, call(SEARCH, '{"color": "wild", "gender": ""}') + 'Action Input: {"size": "medium", "page": 1}', 1.0),
    # an unparsable block is skipped, the good one still counts
    (2, call(SEARCH, '{"color": wild}') + f"Action Input: {S2}", 1.0),
    # line 3
    (3, call(FACTS, HABITAT), 1.0),
    (3, call(FACTS, HABITAT.replace("habitat", "habitats")), 0.0),
    (3, call(FACTS, HABITAT) * 2, 0.0),  # same inputs but the multiset of actions differs
    # line 7: three calls, the merged dict keeps the last size
    (7, searches("small", "medium", "large"), 1.0),
    (7, searches("large", "medium", "small"), 0.0),  # same calls, other order: merged size is "small"
    (7, searches("medium", "large"), 0.0),
    (7, call(SEARCH) * 3 + f"Action Input: {search('large')}", 1.0),  # a quirk of the published rule
    # line 10: two calls; merged gender is "female"
    (10, call(SEARCH, search("medium", gender="male")) + call(SEARCH, FEMALE), 1.0),
    (10, call(SEARCH, FEMALE) + call(SEARCH, search("medium", gender="male")), 0.0),
    # line 18: two different tools, a list value inside the JSON (no nested braces)
    (18, call("checkIPReputation", IP) + call("reportAbusiveIP", REPORT), 1.0),
    (18, call("reportAbusiveIP", REPORT) + call("checkIPReputation", IP), 1.0),
    (18, call("checkIPReputation", IP), 0.0),  # second call missing
    (18, call("checkIPReputation", IP) + call("reportAbusiveIP", REPORT_SWAPPED), 0.0),  # list order matters
    # line 34: "[Optional]updateUserProfile" can never be matched by Action:\s*(\w+)
    (
        34,
        call("getUserProfile", '{"userId": "g-user123", "accessToken": "abcd1234"}')
        + call("[Optional]updateUserProfile", "{}"),
        0.0,
    ),
]


@pytest.mark.parametrize(("line", "response", "expected"), CASES)
def test_tooluse_reward_on_real_rows(line, response, expected):
    assert get_reward_fn("tooluse")(response, gold(line)) == expected


def test_enough_tooluse_cases():
    assert len(CASES) >= 25
