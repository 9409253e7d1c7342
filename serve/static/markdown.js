// A small markdown subset, rendered as DOM nodes, never as HTML: model output reaches the page
// only through text nodes. Supported: paragraphs (single newlines kept as line breaks), fenced
// code blocks (``` or ~~~, an unclosed fence runs to the end, as while an answer streams),
// headings, bullet and numbered lists, inline code, **bold** / __bold__, *italic* / _italic_.
// Lines are split on "\n" only (a trailing "\r" is dropped), never on other Unicode line breaks.
"use strict";

(function () {
  const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
  const BULLET = /^([ \t]*)[-*+][ \t]+(.*)$/;
  const NUMBERED = /^([ \t]*)(\d{1,9})[.)][ \t]+(.*)$/;
  const CODE_SPAN = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g;
  const EMPHASIS = new RegExp([
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,
    /(?<![\p{L}\p{N}_])__(?=\S)([\s\S]*?\S)__(?![\p{L}\p{N}_])/.source,
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source,
    /(?<![\p{L}\p{N}_])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\p{L}\p{N}_])/.source,
  ].join("|"), "gu");

  function element(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  // Bold and italic around plain text (nested emphasis allowed); everything else stays text.
  function appendEmphasis(parent, text) {
    let last = 0;
    for (const match of text.matchAll(EMPHASIS)) {
      parent.append(text.slice(last, match.index));
      const strong = match[1] !== undefined || match[2] !== undefined;
      const node = element(strong ? "strong" : "em");
      appendEmphasis(node, match[1] ?? match[2] ?? match[3] ?? match[4]);
      parent.append(node);
      last = match.index + match[0].length;
    }
    parent.append(text.slice(last));
  }

  // Inline code first: its content is literal, emphasis markers included.
  function appendInline(parent, text) {
    let last = 0;
    for (const match of text.matchAll(CODE_SPAN)) {
      appendEmphasis(parent, text.slice(last, match.index));
      const code = element("code");
      code.textContent = match[2];
      parent.append(code);
      last = match.index + match[0].length;
    }
    appendEmphasis(parent, text.slice(last));
  }

  function listItem(line) {
    let m = BULLET.exec(line);
    if (m) return { ordered: false, indent: m[1].length, text: m[2] };
    m = NUMBERED.exec(line);
    if (m) return { ordered: true, indent: m[1].length, start: Number(m[2]), text: m[3] };
    return null;
  }

  function render(text) {
    const root = document.createDocumentFragment();
    const lines = String(text).split("\n").map((line) => (line.endsWith("\r") ? line.slice(0, -1) : line));
    let paragraph = null;
    let list = null;  // {node, ordered, lastItem}
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      if (fence) {
        paragraph = list = null;
        const marker = fence[1];
        const closing = new RegExp("^ {0,3}" + (marker[0] === "`" ? "`" : "~") + "{" + marker.length + ",}[ \\t]*$");
        const body = [];
        for (i++; i < lines.length && !closing.test(lines[i]); i++) body.push(lines[i]);
        i++;  // the closing fence (or past the end)
        const block = element("div", "code-block");
        if (fence[2]) {
          const label = element("div", "code-lang");
          label.textContent = fence[2];
          block.append(label);
        }
        const pre = element("pre");
        const code = element("code");
        code.textContent = body.join("\n");
        pre.append(code);
        block.append(pre);
        root.append(block);
        continue;
      }
      i++;
      if (line.trim() === "") {
        paragraph = list = null;
        continue;
      }
      const heading = HEADING.exec(line);
      if (heading) {
        paragraph = list = null;
        const node = element("h" + Math.min(heading[1].length + 2, 6), "md-heading");
        appendInline(node, heading[2]);
        root.append(node);
        continue;
      }
      const item = listItem(line);
      if (item) {
        paragraph = null;
        if (!list || list.ordered !== item.ordered) {
          list = { node: element(item.ordered ? "ol" : "ul"), ordered: item.ordered, lastItem: null };
          if (item.ordered && item.start !== 1) list.node.start = item.start;
          root.append(list.node);
        }
        const li = element("li", item.indent >= 2 ? "nested" : "");
        appendInline(li, item.text);
        list.node.append(li);
        list.lastItem = li;
        continue;
      }
      if (list && /^[ \t]+\S/.test(line)) {  // an indented line continues the last list item
        list.lastItem.append(element("br"));
        appendInline(list.lastItem, line.trim());
        continue;
      }
      list = null;
      if (paragraph) {
        paragraph.append(element("br"));
      } else {
        paragraph = element("p");
        root.append(paragraph);
      }
      appendInline(paragraph, line);
    }
    return root;
  }

  window.jaxserveMarkdown = { render };
})();
