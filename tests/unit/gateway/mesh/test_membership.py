"""Discovery's policy as plain functions: role-list parsing, dp-rank order, stale heartbeats and
the diff between what discovery wants and what the gateway has."""

from __future__ import annotations

import pytest

from meshlm.gateway.mesh.membership import (
    DnsName,
    address_order,
    diff,
    live_members,
    ordered,
    parse_entry,
    replica_address,
    split_entries,
    wanted,
)


@pytest.mark.parametrize("entry, parsed", [
    ("127.0.0.1:50052", "127.0.0.1:50052"),
    ("[::1]:50052", "[::1]:50052"),
    ("scheduler:50052", "scheduler:50052"),
    ("dns:///schedulers.meshlm.test:50052", DnsName("schedulers.meshlm.test", 50052)),
    ("dns:schedulers.meshlm.test:7", DnsName("schedulers.meshlm.test", 7)),
    ("dns:///scheduler.default.svc.cluster.local.:80",
     DnsName("scheduler.default.svc.cluster.local", 80)),
    ("dns:///scheduler:1", DnsName("scheduler", 1)),
])
def test_entries_are_static_addresses_or_dns_names(entry, parsed):
    assert parse_entry(entry) == parsed


@pytest.mark.parametrize("entry", [
    "dns:///schedulers.meshlm.test", "dns:///:50052", "dns:///name:port", "dns:name:0",
    "dns:name:65536", "dns://8.8.8.8/name:80",
])
def test_bad_dns_entries_name_the_flag(entry):
    with pytest.raises(ValueError, match="--schedulers"):
        parse_entry(entry, "--schedulers")


def test_split_keeps_static_order():
    static, names = split_entries(["b:2", "dns:///x.test:9", "a:1", "dns:y.test:8"])
    assert static == ["b:2", "a:1"]
    assert names == [DnsName("x.test", 9), DnsName("y.test", 8)]


def test_resolved_addresses_are_dialable():
    assert replica_address("10.0.0.7", 50052) == "10.0.0.7:50052"
    assert replica_address("fd00::7", 50052) == "[fd00::7]:50052"


def test_static_first_in_order_then_discovered_sorted():
    static = ["10.0.0.9:1", "10.0.0.1:1"]
    discovered = ["10.0.0.10:1", "10.0.0.2:1", "10.0.0.9:1", "[fd00::1]:1", "scheduler-b:1",
                  "10.0.0.2:0"]
    assert ordered(static, discovered) == [
        "10.0.0.9:1", "10.0.0.1:1",                  # static, as configured
        "10.0.0.2:0", "10.0.0.2:1", "10.0.0.10:1",   # IPv4 numerically (not "10" < "2")
        "[fd00::1]:1", "scheduler-b:1",              # then IPv6, then host names
    ]


def test_order_is_the_same_whatever_the_arrival_order():
    a = ["127.0.0.3:5", "127.0.0.2:5", "127.0.0.12:5"]
    assert ordered([], a) == ordered([], reversed(a)) == ["127.0.0.2:5", "127.0.0.3:5",
                                                          "127.0.0.12:5"]
    assert address_order("host") == (1, 0, 0, "", 0)  # no port: still sortable


def test_stale_heartbeats_are_left_out():
    expiries = {"a:1": 103.0, "b:1": 100.0, "c:1": 99.5}
    assert live_members(expiries, now=100.0) == {"a:1"}
    assert live_members(expiries, now=99.0) == {"a:1", "b:1", "c:1"}
    assert live_members({}, now=0.0) == set()


def test_wanted_merges_heartbeats_and_dns_answers():
    name = DnsName("schedulers.test", 5)
    want = wanted({"10.0.0.1:5", "h:5"}, {name: ["10.0.0.2:5", "10.0.0.1:5"]})
    # A resolved address is verified against its DNS name, also when it announces itself.
    assert want == {"10.0.0.1:5": "schedulers.test", "10.0.0.2:5": "schedulers.test",
                    "h:5": None}


def test_diff_adds_what_is_new_and_removes_what_left():
    add, remove = diff(["10.0.0.1:5", "10.0.0.3:5"],
                       {"10.0.0.3:5": "n", "10.0.0.2:5": "n", "10.0.0.10:5": None})
    assert add == {"10.0.0.2:5": "n", "10.0.0.10:5": None}
    assert list(add) == ["10.0.0.2:5", "10.0.0.10:5"]  # in rank order
    assert remove == ["10.0.0.1:5"]


def test_diff_of_the_same_set_changes_nothing():
    assert diff(["a:1", "b:1"], {"b:1": None, "a:1": "x"}) == ({}, [])
    assert diff([], {}) == ({}, [])
    assert diff(["a:1"], {}) == ({}, ["a:1"])
