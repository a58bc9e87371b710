"""Each rule's own cases (its ``fires_on`` / ``quiet_on`` fixtures), without a diagnosis."""

from __future__ import annotations

import pytest

from fp16doctor.diagnosis.rules import all_rules

RULES = all_rules()
FIRES = [(r, i) for r in RULES for i in range(len(r.fires_on))]
QUIET = [(r, i) for r in RULES for i in range(len(r.quiet_on))]


def test_every_rule_carries_cases_both_ways():
    assert all(r.fires_on and r.quiet_on for r in RULES), [r.code for r in RULES if not (r.fires_on and r.quiet_on)]


@pytest.mark.parametrize("rule,index", FIRES, ids=[f"{r.code}:{i}" for r, i in FIRES])
def test_rule_fires_on_its_cases(rule, index):
    findings = rule.check(rule.fires_on[index]())
    assert [f.cause for f in findings][:1] == [rule.code]
    assert findings[0].title and findings[0].evidence and findings[0].fix.summary


@pytest.mark.parametrize("rule,index", QUIET, ids=[f"{r.code}:{i}" for r, i in QUIET])
def test_rule_stays_quiet_on_its_near_misses(rule, index):
    assert rule.check(rule.quiet_on[index]()) == []
