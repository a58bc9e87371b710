"""Each rule's own cases (its ``fires_on`` / ``quiet_on`` fixtures), without a diagnosis."""

from __future__ import annotations

import pytest

from fp16doctor.diagnosis.rules import all_rules

RULES = all_rules()
FIRES = [(r, i) for r in RULES for i in range(len(r.fires_on))]
QUIET = [(r, i) for r in RULES for i in range(len(r.quiet_on))]


NAMES = [(r, i) for r in RULES for i in range(len(r.names_cases))]


def test_every_rule_carries_cases_both_ways():
    """A rule that checks evidence has cases it fires on and near misses; one named only by the intervention
    search (no check of its own) has the repairs it names instead."""
    lacking = [r.code for r in RULES if not (r.fires_on and r.quiet_on) and not (r.names_cases and not r.fires_on)]
    assert not lacking


def test_every_rule_that_names_repairs_carries_cases():
    assert all(r.names_cases for r in RULES if r.repairs), [r.code for r in RULES if r.repairs and not r.names_cases]


@pytest.mark.parametrize("rule,index", NAMES, ids=[f"{r.code}:{i}" for r, i in NAMES])
def test_the_first_rule_in_causal_order_to_name_its_repair_is_the_rule(rule, index):
    repair, evidence = rule.names_cases[index]()
    namers = [r.code for r in RULES if r.names_repair(repair, evidence)]
    assert namers[:1] == [rule.code], namers
    finding = rule.repair_finding(repair, evidence)
    assert finding.found_by == "intervention" and finding.severity == "error" and finding.cause == rule.code
    assert finding.fix.summary and finding.evidence_json()["intervention"] == repair.description


@pytest.mark.parametrize("rule,index", FIRES, ids=[f"{r.code}:{i}" for r, i in FIRES])
def test_rule_fires_on_its_cases(rule, index):
    findings = rule.check(rule.fires_on[index]())
    assert [f.cause for f in findings][:1] == [rule.code]
    assert findings[0].title and findings[0].evidence_json() and findings[0].fix.summary


@pytest.mark.parametrize("rule,index", QUIET, ids=[f"{r.code}:{i}" for r, i in QUIET])
def test_rule_stays_quiet_on_its_near_misses(rule, index):
    assert rule.check(rule.quiet_on[index]()) == []


def test_every_rule_declares_a_frozen_evidence_record():
    from dataclasses import fields, is_dataclass

    from fp16doctor.diagnosis.findings import EvidenceRecord

    for rule in RULES:
        record = rule.evidence_type
        assert issubclass(record, EvidenceRecord) and is_dataclass(record), rule.code
        assert record.__dataclass_params__.frozen, rule.code  # type: ignore[attr-defined]
        assert fields(record) or rule.fires_on == (), rule.code


@pytest.mark.parametrize("rule,index", FIRES, ids=[f"{r.code}:{i}" for r, i in FIRES])
def test_a_rules_findings_carry_a_record_declared_beside_it(rule, index):
    """Evidence is the rule's own frozen record (declared in the rule's module), serialised by one function."""
    import sys
    from dataclasses import FrozenInstanceError, fields

    from fp16doctor.diagnosis.findings import evidence_json

    for finding in rule.check(rule.fires_on[index]()):
        record = finding.evidence
        assert type(record).__module__ == type(rule).__module__, (rule.code, type(record))
        assert set(evidence_json(record)) <= {f.name for f in fields(record)}
        with pytest.raises(FrozenInstanceError):
            record.__setattr__(fields(record)[0].name, None)
        assert sys.modules[type(rule).__module__]
