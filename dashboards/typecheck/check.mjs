// Type-checks Grafana dashboard JSON files against Grafana's own Dashboard type (npm @grafana/schema).
//
//   NODE_PATH_ROOT=<dir holding node_modules with @grafana/schema + typescript> node check.mjs ../kv_transfer.json
//
// Each JSON file becomes `export const dashboard = <the JSON> satisfies Dashboard;` in a generated .ts file. The
// JSON is pasted as an object literal, not imported, so TypeScript's excess-property checks apply to every nested
// object: a misspelt key (`fieldconfig`, `gridpos.width`) fails, not only a wrong type. Panel options are checked
// too, against the panel plugin's own Options type from the same package (timeseries, stat, heatmap).
// The schema spells many fields as TypeScript string enums (FieldColorModeId, LegendDisplayMode...), which only
// enum members satisfy; JSON holds their string values, so `AsJson<T>` swaps every string enum for the union of
// its values (`${Enum}`) and leaves everything else, optional keys and index signatures included, as it is.
// Exit status: tsc's (0 = every file type-checks). scripts/setup-observability.sh installs the packages.
import { execFileSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { basename, join, resolve } from "node:path";

const root = process.env.NODE_PATH_ROOT;
if (!root) {
  console.error("set NODE_PATH_ROOT to the folder whose node_modules has @grafana/schema and typescript");
  process.exit(2);
}
const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node check.mjs DASHBOARD.json...");
  process.exit(2);
}
// The generated files live under `root` so that node module resolution finds its node_modules.
mkdirSync(join(root, "generated"), { recursive: true });
const out = mkdtempSync(join(root, "generated", "check-"));
const panelTypes = {
  timeseries: ["TimeSeriesOptions", "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen", "Options"],
  stat: ["StatOptions", "@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen", "Options"],
  table: ["TableOptions", "@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen", "Options"],
  heatmap: ["HeatmapOptions", "@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen", "Options"],
};
const names = [];
for (const file of files) {
  const text = readFileSync(resolve(file), "utf8");
  const parsed = JSON.parse(text); // a JSON syntax error fails here, with its position
  const name = basename(file).replace(/[^A-Za-z0-9]/g, "_");
  const lines = [
    `import type { Dashboard } from "@grafana/schema";`,
    "type AsJson<T> = T extends string ? (string extends T ? string : `${T}`)",
    "  : T extends readonly (infer U)[] ? AsJson<U>[]",
    "  : T extends object ? { [K in keyof T]: AsJson<T[K]> } : T;",
    ...Object.values(panelTypes).map(([alias, mod, sym]) => `import type { ${sym} as ${alias} } from "${mod}";`),
    `export const dashboard = ${text.trim()} satisfies AsJson<Dashboard>;`,
  ];
  // Panel options against their plugin's Options type, one literal per panel (fresh literals again).
  (parsed.panels || []).forEach((panel, index) => {
    const entry = panelTypes[panel.type];
    if (entry && panel.options !== undefined) {
      lines.push(`export const options_${index}_${panel.type} = ${JSON.stringify(panel.options)} satisfies AsJson<Partial<${entry[0]}>>;`);
    }
  });
  writeFileSync(join(out, `${name}.ts`), lines.join("\n") + "\n");
  names.push(`${name}.ts`);
}
writeFileSync(
  join(out, "tsconfig.json"),
  JSON.stringify({
    compilerOptions: {
      strict: true, noEmit: true, target: "ES2022", module: "ESNext", moduleResolution: "Bundler",
      skipLibCheck: true, types: [],
    },
    files: names,
  }, null, 2),
);
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");
try {
  const stdout = execFileSync(process.execPath, [tsc, "-p", join(out, "tsconfig.json")], { encoding: "utf8" });
  process.stdout.write(stdout);
  console.log(`OK: ${files.join(", ")} satisfy Dashboard (@grafana/schema)`);
} catch (err) {
  process.stdout.write(err.stdout || "");
  process.stderr.write(err.stderr || "");
  process.exitCode = err.status || 1;
} finally {
  rmSync(out, { recursive: true, force: true });
}
