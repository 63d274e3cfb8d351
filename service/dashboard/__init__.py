"""The dashboard's pages: Jinja2 templates (``templates/``), its own script and stylesheet
(``static/``), and the functions that turn stored solutions and validations into what the pages
show (``views``). The routes are ``sigprop.api.dashboard``; plotly.js is served from the installed
``plotly`` package, never from a CDN or from this repository."""
