"""The ``MonitoredSession`` front end: sessions, their wrappers, creators and ``Scaffold``."""
