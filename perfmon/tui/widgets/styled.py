"""Component styles of a panel as a dict, computed once and kept until the CSS or theme changes.

``get_component_rich_style`` costs about 0.3 ms a name: over a dozen names, at every redraw,
that was most of what drawing a panel cost.
"""

from __future__ import annotations

from typing import ClassVar

from rich.style import Style
from textual.widget import Widget


class StyledWidget(Widget):
    """A widget whose ``COMPONENT_CLASSES`` styles come from :meth:`component_styles`."""

    #: True: styles without a background of their own (what is under them shows through)
    PARTIAL_STYLES: ClassVar[bool] = False
    _panel_styles: dict[str, Style] | None = None

    def component_styles(self) -> dict[str, Style]:
        """``{"value": Style, ...}`` for ``COMPONENT_CLASSES`` named ``panel--value``."""
        if self._panel_styles is None:
            self._panel_styles = {
                name.split("--", 1)[1]: self.get_component_rich_style(name, partial=self.PARTIAL_STYLES)
                for name in self.COMPONENT_CLASSES
            }
        return self._panel_styles

    def notify_style_update(self) -> None:
        self._panel_styles = None
        super().notify_style_update()
