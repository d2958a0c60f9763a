"""The ``Supervisor`` front end: the facade, its ``SessionManager`` and its services."""
