// Drives the Halfmoon console in headless Chromium and prints one JSON summary line.
//
//   node tests/e2e/console_browser.mjs --url http://127.0.0.1:8501 --out reports/console
//
// Opens the console, waits for its plotly charts and for no stale element, reads the KV hit
// rate metrics, opens the Pools tab and collects the instance ids and chart titles it shows,
// opens the KV cache tab (hit rate, KV activity), then the Requests tab (the newest request's
// timeline and placement), and saves a full-page screenshot of each. The caller (test_console_browser.py) asserts
// on the summary. playwright-core is resolved from <repo>/.cache/node (scripts/install-browser.sh
// puts it there) or HALFMOON_NODE_PREFIX; the browser is Debian's /usr/bin/chromium
// (HALFMOON_CHROMIUM), never one downloaded by playwright.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '..', '..');
const prefix = process.env.HALFMOON_NODE_PREFIX || path.join(repo, '.cache', 'node');
const require = createRequire(path.join(prefix, 'package.json'));
const { chromium } = require('playwright-core');

function option(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

const url = option('url', 'http://127.0.0.1:8501');
const outDir = path.resolve(option('out', path.join(repo, 'reports', 'console')));
// How long any one wait may take (a failure bound: each ends once its condition holds).
const timeout = Number(option('timeout-ms', '60000'));
const CHART = '[data-testid="stPlotlyChart"] .main-svg';
// Streamlit keeps every tab's panel in the page; only the selected one is shown.
const PANEL = '[role="tabpanel"]:not([hidden])';
const INSTANCE_RE = /\b(?:prefill|decode)-\d+\b/g;

const summary = { url, screenshots: {}, errors: [] };

async function settle(page, scope) {
  await page.locator(`${scope} ${CHART}`).first().waitFor({ state: 'visible', timeout });
  await page.waitForFunction(() => !document.querySelector('[data-stale="true"]'), null,
    { timeout, polling: 100 });
}

// Streamlit scrolls inside its main block, so a full-page shot of a small window cuts the page:
// grow the window to the content first, then wait for the charts to redraw.
async function shoot(page, name) {
  const height = await page.evaluate(() => {
    const main = document.querySelector('[data-testid="stMain"]') || document.body;
    return Math.ceil(Math.max(main.scrollHeight, document.body.scrollHeight));
  });
  await page.setViewportSize({ width: 1400, height: Math.min(Math.max(height + 40, 900), 6000) });
  await settle(page, PANEL);
  await page.waitForTimeout(300); // plotly's resize transition
  const file = path.join(outDir, `console-${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  summary.screenshots[name] = file;
}

// Metrics of the shown tab: {label: value}.
async function metrics(page) {
  return page.evaluate((panel) => {
    const out = {};
    for (const m of document.querySelectorAll(`${panel} [data-testid="stMetric"]`)) {
      const label = m.querySelector('[data-testid="stMetricLabel"]')?.innerText.trim();
      const value = m.querySelector('[data-testid="stMetricValue"]')?.innerText.trim();
      if (label) out[label] = value ?? '';
    }
    return out;
  }, PANEL);
}

function hitRate(found) {
  const entry = Object.entries(found).find(([label]) => /hit/i.test(label));
  return entry ? { label: entry[0], text: entry[1], percent: parseFloat(entry[1]) } : null;
}

// The shown tab's text, headers and chart text (titles, legends, axis labels).
async function panelText(page) {
  return page.evaluate((panel) => {
    const root = document.querySelector(panel);
    return {
      text: root.innerText,
      headers: [...root.querySelectorAll('h1, h2, h3')].map((h) => h.innerText.trim()),
      chart_titles: [...root.querySelectorAll('svg .gtitle')].map((t) => t.textContent.trim()),
      chart_text: [...root.querySelectorAll('svg text')].map((t) => t.textContent).join('\n'),
    };
  }, PANEL);
}

// Poll a metric of the shown tab until it parses to a number above zero, or the time is up.
async function readPositive(page, label, ms) {
  const until = Date.now() + ms;
  for (;;) {
    const text = (await metrics(page))[label];
    const value = text === undefined ? null : parseFloat(text.replace(/,/g, ''));
    if ((value !== null && value > 0) || Date.now() > until) return value;
    await page.waitForTimeout(500);
  }
}

// Poll the shown tab's hit-rate metric until it is a number above zero (the console refreshes
// itself every few seconds) or the time is up; returns what it read last.
async function readHitRate(page, ms) {
  const until = Date.now() + ms;
  let last = null;
  for (;;) {
    last = hitRate(await metrics(page));
    if ((last && last.percent > 0) || Date.now() > until) return last;
    await page.waitForTimeout(500);
  }
}

async function openTab(page, name) {
  // The console refreshes itself every few seconds; a click that lands mid-rerun can be
  // lost, so click again until the tab reports itself selected.
  const until = Date.now() + timeout;
  for (;;) {
    await page.getByRole('tab', { name, exact: true }).click();
    try {
      await page.waitForFunction((n) => {
        const tab = [...document.querySelectorAll('[role="tab"]')]
          .find((t) => t.innerText.trim() === n);
        return tab && tab.getAttribute('aria-selected') === 'true';
      }, name, { timeout: 3000 });
      break;
    } catch (err) {
      if (Date.now() > until) throw err;
    }
  }
  await settle(page, PANEL);
}

async function main() {
  fs.mkdirSync(outDir, { recursive: true });
  const browser = await chromium.launch({
    executablePath: process.env.HALFMOON_CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    page.on('pageerror', (e) => summary.errors.push(`pageerror: ${e.message}`));
    await page.goto(url, { waitUntil: 'domcontentloaded', timeout });
    summary.title = await page.title();

    // Overview: the first tab.
    await settle(page, PANEL);
    summary.overview_hit_rate = await readHitRate(page, timeout);
    summary.overview_metrics = await metrics(page);
    await shoot(page, 'overview');

    // Pools: instance ids from the panel's text and the load chart's axis labels (the tables
    // are drawn on a canvas, so their cells are not page text).
    await openTab(page, 'Pools');
    const pools = await page.evaluate((panel) => {
      const root = document.querySelector(panel);
      const svgText = [...root.querySelectorAll('svg text')].map((t) => t.textContent).join('\n');
      return {
        text: root.innerText,
        chart_text: svgText,
        headers: [...root.querySelectorAll('h1, h2, h3')].map((h) => h.innerText.trim()),
        captions: [...root.querySelectorAll('[data-testid="stCaptionContainer"]')]
          .map((c) => c.innerText.trim()),
        alerts: [...root.querySelectorAll('[data-testid="stAlert"]')].map((a) => a.innerText.trim()),
      };
    }, PANEL);
    const ids = (text) => [...new Set(text.match(INSTANCE_RE) || [])].sort();
    summary.instances = ids(`${pools.text}\n${pools.chart_text}`);
    summary.instances_in_text = ids(pools.text);
    summary.instances_in_chart = ids(pools.chart_text);
    summary.pool_headers = pools.headers;
    summary.pool_captions = pools.captions;
    summary.pool_alerts = pools.alerts;
    summary.pool_chart_titles = (await panelText(page)).chart_titles;
    await shoot(page, 'pools');

    // KV cache: the cluster hit rate and its chart.
    await openTab(page, 'KV cache');
    summary.kv_hit_rate = await readHitRate(page, timeout);
    // The conductor samples heartbeats every few seconds: wait for one with the handoffs.
    summary.kv_transfers_in = await readPositive(page, 'Transfers in', timeout);
    summary.kv_metrics = await metrics(page);
    const kv = await panelText(page);
    summary.kv_headers = kv.headers;
    summary.kv_chart_titles = kv.chart_titles;
    await shoot(page, 'kv');

    // Requests: the newest request is picked; its timeline and the conductor's reasons.
    await openTab(page, 'Requests');
    const req = await panelText(page);
    summary.request_chart_titles = req.chart_titles;
    summary.request_chart_text = req.chart_text;
    summary.request_placement = req.text.split('\n').filter((l) => l.startsWith('Placement.'));
    await shoot(page, 'requests');
  } finally {
    await browser.close();
  }
}

main().then(
  () => { console.log(JSON.stringify(summary)); },
  (err) => {
    summary.errors.push(String(err && err.stack ? err.stack : err));
    console.log(JSON.stringify(summary));
    process.exitCode = 1;
  },
);
