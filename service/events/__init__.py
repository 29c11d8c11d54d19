"""Events out: every acknowledged gallery change (and, opted in, every identification) as an
entry of a capped Redis stream (:mod:`service.events.stream`), delivered to the configured
webhooks by a background worker of each service process (:mod:`service.events.delivery`)."""
