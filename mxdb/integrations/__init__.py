"""Integrations of the dispatcher with model libraries (imported on demand, never by ``mxdb``)."""
