"""FeedFnHook: every run gets the feed of the function."""

from __future__ import annotations

from monitored_helpers import Counter

from torchsupervisor.hooks import FeedFnHook
from torchsupervisor.monitored.creators import ChiefSessionCreator
from torchsupervisor.monitored.session import MonitoredSession


def test_feed_fn_feeds_every_run():
    counter = Counter()
    values = iter(range(10, 20))
    seen = []
    hook = FeedFnHook(lambda: {"x": next(values)})
    with MonitoredSession(ChiefSessionCreator(state=counter.state), hooks=[hook]) as sess:
        for _ in range(3):
            sess.run(lambda x: seen.append(x))
    assert seen == [10, 11, 12]
