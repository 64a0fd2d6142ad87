// MathJax settings for the formulas `pymdownx.arithmatex` (generic mode) leaves in the
// pages: inline \( ... \) and display \[ ... \], only inside its `arithmatex` elements.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
