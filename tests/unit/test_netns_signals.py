"""How the namespaced test bed's scripts take Ctrl-C and SIGTERM (``bench/netns_hosts.py``): the first
one unwinds (so that what they made is removed), and no later one cuts that cleanup short."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bench import netns_hosts


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_the_first_signal_unwinds_and_later_ones_are_ignored(restore_handlers):
    netns_hosts.install_signal_handlers()
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        _signal_self(signal.SIGTERM)
    _signal_self(signal.SIGINT)  # while that unwinding cleans up: nothing raised
    _signal_self(signal.SIGTERM)


def test_a_signal_during_cleanup_is_raised_only_once_the_cleanup_is_done(restore_handlers):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    with pytest.raises(KeyboardInterrupt, match="signal 2"):
        with netns_hosts._signals_deferred():
            _signal_self(signal.SIGINT)
            done.append("the rest of the cleanup")
    assert done == ["the rest of the cleanup"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    with netns_hosts._signals_deferred():  # no signal: nothing raised
        done.append("again")
