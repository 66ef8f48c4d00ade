"""The status page's list of GPU references: for each box that ran `make gpu-references`
(a results/<gpu>-x<N>/summary.json), the GPU, how many, when, with which driver, CUDA, NCCL
and torch, and which labs ran or failed there. Where there is none, it says so.

    ```{gpu-references}
    ```
"""

import json
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

from chapter_times import make_table   # book/_ext is on the path (local_extensions)


class GpuReferences(SphinxDirective):
    def run(self):
        labs = Path(self.env.srcdir) / "labs"
        sys.path.insert(0, str(labs))
        from labkit.runtime import references   # torch-free
        results = labs.parent / "results"
        rows = []
        for folder, summary in references.boxes(results):
            ran = [o["lab"] for o in summary["labs"] if o["ok"]]
            failed = references.failures(summary)   # each with its own first error line
            # the versions and date as the first lab that ran wrote them
            first = next((json.loads((results / folder / f"{lab}.json").read_text())
                          ["reference"] for lab in ran), {})
            rows.append([f"results/{folder}", summary.get("gpu") or "CPU",
                         summary["world_size"], first.get("date", "-")[:10],
                         references.versions(first) or "-",
                         ", ".join(ran) or "-", "; ".join(failed) or "-"])
            self.env.note_dependency(str(results / folder / "summary.json"))
        if not rows:
            return [nodes.paragraph(text=(
                "No GPU reference is recorded yet: every figure in this book comes from the "
                "CPU of the machine that built it."))]
        return [make_table(["folder", "GPU", "GPUs", "date", "versions", "labs", "failed, why"],
                           rows, [14, 14, 5, 9, 16, 18, 24])]


def setup(app):
    app.add_directive("gpu-references", GpuReferences)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
