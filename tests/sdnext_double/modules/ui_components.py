"""SD.Next's ``InputAccordion`` (modules/ui_components.py, marked "unused" there): a hidden checkbox
(``elem_id`` + "-checkbox") carrying the value and a ``gr.Accordion`` (``elem_id``, class "input-accordion",
open when the value is True) holding the controls when used as a context manager."""

from __future__ import annotations

import gradio as gr


class InputAccordion(gr.Checkbox):
    global_index = 0

    def __init__(self, value, **kwargs):
        self.accordion_id = kwargs.get("elem_id")
        if self.accordion_id is None:
            self.accordion_id = f"input-accordion-{InputAccordion.global_index}"
            InputAccordion.global_index += 1
        kwargs_checkbox = {**kwargs, "elem_id": f"{self.accordion_id}-checkbox", "visible": False}
        super().__init__(value, **kwargs_checkbox)
        self.change(fn=None, _js='function(checked){ inputAccordionChecked("' + self.accordion_id + '", checked); }',
                    inputs=[self])
        kwargs_accordion = {**kwargs, "elem_id": self.accordion_id, "label": kwargs.get("label", "Accordion"),
                            "elem_classes": ["input-accordion"], "open": value}
        self.accordion = gr.Accordion(**kwargs_accordion)

    def extra(self):
        return gr.Column(elem_id=self.accordion_id + "-extra", elem_classes="input-accordion-extra", min_width=0)

    def __enter__(self):
        self.accordion.__enter__()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.accordion.__exit__(exc_type, exc_val, exc_tb)

    def get_block_name(self):
        return "checkbox"
