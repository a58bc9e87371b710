"""Rendering of the records and findings the API returns: terminal, Markdown, HTML, plots. Nothing here measures."""
