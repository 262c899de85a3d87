"""``InputAccordion``: an accordion whose open/closed state is a boolean input ("enabled").

As in the webui, the returned component is a hidden checkbox (``elem_id`` + "-checkbox") that carries the value,
and a real ``gr.Accordion`` (``elem_id``, class "input-accordion", open when the value is True) holds the
controls when used as a context manager.
"""

from __future__ import annotations

import itertools

import gradio as gr

# Opens or closes the accordion when the value changes on the server side (e.g. after a paste). The webui does
# this (and the reverse link) in its own javascript; the double's page has only this.
_SYNC_JS = """(checked) => {
    const header = document.querySelector('#%s .label-wrap');
    if (header && header.classList.contains('open') !== Boolean(checked)) header.click();
    return [];
}"""


class InputAccordion(gr.Checkbox):
    _unnamed = itertools.count()

    def __init__(self, value: bool, **kwargs) -> None:
        self.accordion_id = kwargs.get("elem_id") or f"input-accordion-{next(self._unnamed)}"
        checkbox_kwargs = {**kwargs, "elem_id": f"{self.accordion_id}-checkbox", "visible": False}
        super().__init__(value, **checkbox_kwargs)
        self.change(fn=None, _js=_SYNC_JS % self.accordion_id, inputs=[self])
        self.accordion = gr.Accordion(kwargs.get("label", "Accordion"), open=value, elem_id=self.accordion_id,
                                      elem_classes=["input-accordion"])

    def extra(self) -> gr.Column:
        """A column rendered in the accordion's header."""
        return gr.Column(elem_id=f"{self.accordion_id}-extra", elem_classes="input-accordion-extra", min_width=0)

    def __enter__(self) -> "InputAccordion":
        self.accordion.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.accordion.__exit__(*exc_info)

    def get_block_name(self) -> str:
        return "checkbox"
