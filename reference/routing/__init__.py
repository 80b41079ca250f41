"""kvcc.reference.routing: request-routing policies and a cluster simulator that replays
Mooncake's request traces through them (``kvcc bench routing``)."""
