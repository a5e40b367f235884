// A small Markdown subset for the assistant's text: paragraphs (single newlines kept as line breaks),
// fenced code blocks, inline code, bold, italic, and flat bullet or numbered lists.
// The whole text is HTML-escaped first; the only markup in the result is the tags built here.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// The language tag may only hold word characters, '+' and '-', so it is safe inside an attribute.
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)[^`]*$/;
const LIST_ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const CONTINUATION = /^ {2,}\S/;

function emphasis(text) {
  return text
    .replace(/\*\*\*(?=\S)([\s\S]*?\S)\*\*\*/g, "<strong><em>$1</em></strong>")
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
}

// Code spans are cut out first so that emphasis markers inside them stay as typed.
function inline(text) {
  return text
    .split(/(`[^`]+`)/)
    .map((part, i) => (i % 2 ? `<code>${part.slice(1, -1)}</code>` : emphasis(part)))
    .join("");
}

function isOrdered(marker) {
  return /\d/.test(marker);
}

// Consumes the list starting at lines[i]; returns [html, next index].
function list(lines, i) {
  const first = lines[i].match(LIST_ITEM);
  const ordered = isOrdered(first[1]);
  const items = [];
  while (i < lines.length) {
    const item = lines[i].match(LIST_ITEM);
    if (item && isOrdered(item[1]) === ordered) {
      items.push([item[2]]);
    } else if (items.length && CONTINUATION.test(lines[i]) && !FENCE.test(lines[i])) {
      items[items.length - 1].push(lines[i].trim());
    } else {
      break;
    }
    i++;
  }
  const start = ordered && parseInt(first[1], 10) !== 1 ? ` start="${parseInt(first[1], 10)}"` : "";
  const tag = ordered ? "ol" : "ul";
  const body = items.map((parts) => `<li>${parts.map(inline).join("<br>")}</li>`).join("");
  return [`<${tag}${start}>${body}</${tag}>`, i];
}

// Consumes the fenced block starting at lines[i]; an unclosed fence (a reply still streaming) runs
// to the end of the text.
function codeBlock(lines, i) {
  const [, marker, language] = lines[i].match(FENCE);
  const body = [];
  for (i++; i < lines.length; i++) {
    const line = lines[i].trim();
    if (line.startsWith(marker[0].repeat(marker.length)) && /^[`~]+$/.test(line)) {
      i++;
      break;
    }
    body.push(lines[i]);
  }
  const cls = language ? ` class="language-${language}"` : "";
  return [`<pre><code${cls}>${body.join("\n")}</code></pre>`, i];
}

export function renderMarkdown(source) {
  const lines = escapeHtml(source).split(/\r?\n/);
  const out = [];
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    paragraph = [];
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let block = null;
    if (FENCE.test(line)) block = codeBlock(lines, i);
    else if (LIST_ITEM.test(line)) block = list(lines, i);
    if (block) {
      flush();
      out.push(block[0]);
      i = block[1];
      continue;
    }
    if (line.trim() === "") flush();
    else paragraph.push(line);
    i++;
  }
  flush();
  return out.join("");
}
