// Loom's small Markdown renderer: the text is HTML-escaped first, then a few Markdown forms are
// turned into tags this file writes itself (fenced and inline code, headings, lists, quotes,
// bold, italic, links to http(s) only). No HTML from the model ever reaches the page as HTML.
"use strict";

const LoomMarkdown = (() => {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

  const KEYWORDS = new Set((
    "def class return if elif else for while in import from as with try except finally raise " +
    "lambda yield pass break continue and or not is None True False async await function const " +
    "let var new this typeof instanceof switch case default do void delete null undefined true " +
    "false fn pub struct enum impl use mod match mut where trait int float char double long " +
    "unsigned static public private protected package interface extends implements throw " +
    "throws func go defer type select SELECT FROM WHERE INSERT UPDATE DELETE JOIN echo"
  ).split(" "));
  // One pass over the (unescaped) code: comments, strings, numbers, words; each piece escaped.
  const TOKEN = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d+(?:\.\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;

  function highlight(code) {
    let out = "", last = 0, m;
    TOKEN.lastIndex = 0;
    while ((m = TOKEN.exec(code)) !== null) {
      out += escapeHtml(code.slice(last, m.index));
      const text = escapeHtml(m[0]);
      if (m[1]) out += `<span class="tok-comment">${text}</span>`;
      else if (m[2]) out += `<span class="tok-string">${text}</span>`;
      else if (m[3]) out += `<span class="tok-number">${text}</span>`;
      else if (KEYWORDS.has(m[4])) out += `<span class="tok-keyword">${text}</span>`;
      else out += text;
      last = TOKEN.lastIndex;
    }
    return out + escapeHtml(code.slice(last));
  }

  // Inline forms on already-escaped text; code spans are cut out first so nothing inside them
  // is touched.
  function inline(escaped) {
    const parts = escaped.split(/(`[^`\n]+`)/g);
    return parts.map((part, i) => {
      if (i % 2 === 1) return `<code>${part.slice(1, -1)}</code>`;
      return part
        .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
        .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)"]+)\)/g,
                 '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    }).join("");
  }

  function render(source) {
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    const html = [];
    let i = 0, para = [], list = null;
    const flushPara = () => {
      if (para.length) html.push(`<p>${inline(escapeHtml(para.join("\n"))).replace(/\n/g, "<br>")}</p>`);
      para = [];
    };
    const flushList = () => {
      if (list) html.push(`<${list.tag}>${list.items.map((x) => `<li>${inline(escapeHtml(x))}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
      if (fence) {  // a fenced block runs to the closing fence, or to the end while streaming
        flushPara(); flushList();
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        i++;
        const lang = fence[1] ? `<span class="code-lang">${escapeHtml(fence[1])}</span>` : "";
        html.push(`<pre class="code">${lang}<code>${highlight(body.join("\n"))}</code></pre>`);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        flushPara(); flushList();
        const level = Math.min(heading[1].length + 2, 6);  // h3..h6 inside a message
        html.push(`<h${level}>${inline(escapeHtml(heading[2]))}</h${level}>`);
      } else if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
      } else if (/^\s*>\s?/.test(line)) {
        flushPara(); flushList();
        html.push(`<blockquote>${inline(escapeHtml(line.replace(/^\s*>\s?/, "")))}</blockquote>`);
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else {
        flushList();
        para.push(line);
      }
      i++;
    }
    flushPara(); flushList();
    return html.join("");
  }

  return { render, escapeHtml, highlight };
})();
