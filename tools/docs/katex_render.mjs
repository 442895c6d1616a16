// Renders the site's math at build time: reads [[tex, display], ...] as JSON on stdin and
// writes the KaTeX HTML of each formula, as a JSON list, on stdout. The first argument is the
// path of katex.js (the npm package fetched by katex_hook.py). A formula KaTeX cannot parse
// stops the build with the formula in the message.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";

const katex = createRequire(import.meta.url)(process.argv[2]);
const items = JSON.parse(readFileSync(0, "utf8"));
const out = [];
for (const [tex, display] of items) {
  try {
    out.push(katex.renderToString(tex, { displayMode: display, throwOnError: true}));
  } catch (err) {
    process.stderr.write(`KaTeX cannot render ${JSON.stringify(tex)}: ${err.message}\n`);
    process.exit(1);
  }
}
process.stdout.write(JSON.stringify(out));
