"""Each script once per page. sphinx-thebe's inline configuration reaches the page twice
under jupyter-book, and the second `const THEBE_JS_URL` is a SyntaxError in the browser's
console; identical scripts are dropped here, keeping the first."""


def drop_repeated_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        # an inline script's file name is None or "", depending on who added it
        name = getattr(script, "filename", script) or ""
        key = (name, tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", drop_repeated_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
