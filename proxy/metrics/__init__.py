"""What the proxy tells about itself: the Prometheus registry and what fills it
(`registry`), the histograms of what takes time (`durations`), the `--metrics` listener
that serves it (`listener`) and, beside it, the status page an operator watches
(`status_page`), per-request spans (`request_spans`) and a Grafana dashboard of the
families (`grafana_dashboard.json`)."""
