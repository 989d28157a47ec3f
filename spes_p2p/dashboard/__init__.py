"""The swarm's web page: who holds what, coverage, loss, traffic and events, live (``spes dashboard``,
``spes-join --dashboard PORT``).

    config.py    [dashboard]: port and host (imports nothing heavy: every command loads it)
    history.py   what the page remembers between reads: losses and traffic by round, rates, events
    charts.py    SVG line charts, drawn on the server
    metrics.py   the same figures in Prometheus' text format
    server.py    the reader thread and the read-only web server (starlette on uvicorn)
    page.*       the page itself: plain HTML, CSS and a script with no dependencies
"""
