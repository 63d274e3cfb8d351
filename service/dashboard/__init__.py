"""The dashboard, one feature in one folder: its routes (``router``), the functions that turn stored
solutions and validations into what the pages show (``views``), Jinja2 templates (``templates/``),
its own script and stylesheet (``static/``) and how static files are served (``assets``).
plotly.js is served from the installed ``plotly`` package, never from a CDN or from this
repository."""
